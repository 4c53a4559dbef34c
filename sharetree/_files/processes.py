"""The processes a save writes with: JAX's coordination service, or one process."""

from __future__ import annotations

import abc
import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import jax
from jax._src import distributed

from sharetree._errors import error, one_line

__all__ = ["Group", "JaxGroup", "OneProcess", "joined", "current_group"]


_SAVES = itertools.count()
"""Each process numbers its saves of several processes: the same sequence on every process."""


class Group(abc.ABC):
    """The processes of a job, as a save sees them: who this is, and a shared key-value store."""

    me: int
    count: int

    @abc.abstractmethod
    def publish(self, key: str, value: str) -> None:
        """Store ``value`` under ``key`` for every process to read."""

    @abc.abstractmethod
    def read(self, key: str, timeout: float) -> str:
        """The value of ``key`` once it is published; ``TimeoutError`` after ``timeout`` s."""

    def forget(self, prefix: str) -> None:  # noqa: B027 - nothing to do by default
        """Drop every key under ``prefix`` (a finished save's)."""

    def process_of(self, device: Any) -> int:
        """The process that holds ``device``."""
        return int(device.process_index)

    def next_save(self) -> int:
        """The number of this save: each process counts its saves, the same on every process."""
        return next(_SAVES)


class JaxGroup(Group):
    """The processes of ``jax.distributed``: its coordination service's key-value store."""

    def __init__(self, where: str) -> None:
        client = distributed.global_state.client
        self.me, self.count = jax.process_index(), jax.process_count()
        if client is None:  # several processes without jax.distributed (no coordination service)
            what = "cannot write a buffer sharded over several processes: "
            what += "jax.distributed is not initialized (no coordination service)"
            fix = "call jax.distributed.initialize() first, or save with gather=True"
            raise error("E34", where, what, fix=fix)
        self.client = client

    def publish(self, key: str, value: str) -> None:
        self.client.key_value_set(key, value)

    def read(self, key: str, timeout: float) -> str:
        try:
            return str(self.client.blocking_key_value_get(key, max(1, int(timeout * 1000))))
        except Exception as e:  # DEADLINE_EXCEEDED, or the service gone with process 0
            raise TimeoutError(one_line(e)) from e

    def forget(self, prefix: str) -> None:
        with contextlib.suppress(Exception):
            self.client.key_value_delete(prefix)


class OneProcess(Group):
    """This process alone: a save of one process is a plan with one owner and no rounds."""

    me, count = 0, 1

    def publish(self, key: str, value: str) -> None:  # pragma: no cover - no round to publish
        raise RuntimeError("a save of one process publishes nothing")

    def read(self, key: str, timeout: float) -> str:  # pragma: no cover - no round to read
        raise RuntimeError("a save of one process reads nothing")

    def process_of(self, device: Any) -> int:
        return 0


_LOCAL = threading.local()


@contextlib.contextmanager
def joined(group: Group) -> Iterator[Group]:
    """Within the block, this thread's saves are ``group``'s (the tests' simulated processes)."""
    before = getattr(_LOCAL, "group", None)
    _LOCAL.group = group
    try:
        yield group
    finally:
        _LOCAL.group = before


def current_group(where: str) -> Group | None:
    """The processes a save writes with: this thread's :func:`joined` group, JAX's, or none.

    ``where``: the save, for the message of E34 (several processes, no coordination service).
    """
    group = getattr(_LOCAL, "group", None)
    if group is not None:
        return group
    if jax.process_count() > 1:
        return JaxGroup(where)
    return None
