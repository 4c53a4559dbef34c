"""``run_processes(n, fn)``: ``fn(i)`` as ``n`` simulated processes of one job (threads).

Each thread joins one ``ThreadGroup`` (a ``Group`` whose store is a dict shared as the
coordination service's key-value store), so ``st.save`` on several "processes" runs
its rounds in one test process. ``tests/test_multihost.py`` runs real processes.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

from sharetree._files import processes
from sharetree._files.processes import Group


class ThreadGroup(Group):
    """Processes simulated by threads of one process: a shared dict is the store.

    ``store``: one dict shared by the group's members (``ThreadGroup.store()``);
    ``process_of``: which simulated process holds a device (all process 0 by default).
    """

    def __init__(
        self,
        me: int,
        count: int,
        store: dict[str, Any],
        process_of: Callable[[Any], int] | None = None,
    ) -> None:
        self.me, self.count, self.values = me, count, store
        self.changed: threading.Condition = store.setdefault("", threading.Condition())
        self.where = process_of or (lambda device: 0)
        self.saves = itertools.count()

    @staticmethod
    def store() -> dict[str, Any]:
        """A new store for the members of one simulated job."""
        return {"": threading.Condition()}

    def publish(self, key: str, value: str) -> None:
        with self.changed:
            self.values[key] = value
            self.changed.notify_all()

    def read(self, key: str, timeout: float) -> str:
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout):
                raise TimeoutError(f"no value for {key!r} within {timeout:g} s")
            return str(self.values[key])

    def process_of(self, device: Any) -> int:
        return self.where(device)

    def next_save(self) -> int:
        return next(self.saves)


def run_processes(n: int, fn: Any, timeout: float = 60.0) -> list[Any]:
    """``fn(i)`` in ``n`` threads joined to one simulated job: each result or exception."""
    store = ThreadGroup.store()
    out: list[Any] = [None] * n

    def one(i: int) -> None:
        with processes.joined(ThreadGroup(i, n, store)):
            try:
                out[i] = fn(i)
            except BaseException as e:  # returned to the test
                out[i] = e

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a simulated process hangs"
    return out
