"""The plan of a save: each distinct part of a buffer has one owner (the layout from the avals)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, NamedTuple

import jax
import numpy as np

from sharetree._errors import error, short
from sharetree._files.container import Slot
from sharetree._files.processes import Group

__all__ = [
    "Bounds",
    "Part",
    "Spread",
    "Owned",
    "plan_parts",
    "spread",
    "Options",
    "FileOut",
    "Plan",
]


Bounds = tuple[tuple[int, int], ...]
"""A part of an array: ``(start, stop)`` per axis."""


class Part(NamedTuple):
    """One part of a tensor and the process that writes it (``device``: where it is read)."""

    bounds: Bounds
    owner: int
    device: Any


@dataclasses.dataclass(frozen=True, eq=False)
class Spread:
    """A tensor of the file, not read yet: its slot, the array and the parts its processes own.

    ``value``: a ``jax.Array`` (parts read from their devices) or a host array (one part);
    ``raw``: stored as its bytes (``uint8``), ``shape``/``itemsize`` the array's own.
    """

    slot: Slot
    value: Any
    shape: tuple[int, ...]
    itemsize: int
    parts: tuple[Part, ...]

    def summary(self) -> str:
        """What every process must agree on for this tensor: its slot and its plan."""
        parts = [(p.bounds, p.owner) for p in self.parts]
        return json.dumps([*self.slot, list(self.shape), parts], separators=(",", ":"))


class Owned(NamedTuple):
    """A part of an array (its bounds) and the process that writes it."""

    bounds: Bounds
    owner: int


def plan_parts(
    where: str, shape: tuple[int, ...], parts: dict[Bounds, list[int]], load: list[int]
) -> tuple[Owned, ...]:
    """An owner for each distinct part: the process holding it with the fewest bytes so far.

    ``parts``: each part's bounds and the processes holding a replica of it; ``load``:
    the bytes (or elements) each process writes so far, updated. The parts must tile the
    array (a grid of intervals per axis, every cell held), else E222 naming ``where``.

    Example:
        >>> load = [0, 0]
        >>> plan_parts("w", (4,), {((0, 4),): [0, 1]}, load), load
        ((Owned(bounds=((0, 4),), owner=0),), [4, 0])
        >>> [p.owner for p in plan_parts("v", (4,), {((0, 2),): [0, 1], ((2, 4),): [0, 1]}, load)]
        [1, 1]
        >>> load
        [4, 4]
    """
    _check_tiles(where, shape, parts)
    out = []
    for bounds, holders in sorted(parts.items()):
        size = int(np.prod([b - a for a, b in bounds], dtype=np.int64))
        owner = min(sorted(set(holders)), key=lambda p: load[p])
        load[owner] += size
        out.append(Owned(bounds, owner))
    return tuple(out)


def _check_tiles(where: str, shape: tuple[int, ...], parts: dict[Bounds, list[int]]) -> None:
    """E222 unless ``parts`` are exactly the cells of a grid over ``shape`` (each held)."""
    axes: list[set[tuple[int, int]]] = [set() for _ in shape]
    for bounds in parts:
        for a, interval in enumerate(bounds):
            axes[a].add(interval)
    problem = ""
    for a, (n, intervals) in enumerate(zip(shape, axes)):
        at = 0
        for start, stop in sorted(intervals):
            if start != at:
                what = "held by no device" if start > at else "held twice, overlapping"
                problem = f"the indices {min(at, start)}:{max(at, start)} of axis {a} are {what}"
                break
            at = stop
        if not problem and at != n and n > 0:
            problem = f"the indices {at}:{n} of axis {a} are held by no device"
        if problem:
            break
    cells = int(np.prod([len(x) for x in axes], dtype=np.int64)) if shape else 1
    if not problem and len(parts) != cells:
        problem = f"its {len(parts)} distinct parts leave {cells - len(parts)} of a grid unowned"
    if problem:
        what = f"has a sharding whose parts do not cover it: {problem}; nothing was written"
        fix = "reshard it (jax.device_put with a NamedSharding), or save with gather=True"
        raise error("E222", where, what, found=f"parts {short(sorted(parts), 200)}", fix=fix)


def spread(name: str, code: str, x: Any, raw: bool, where: str, group: Group, load: list[int]):
    """The :class:`Spread` of the array ``x`` stored as ``name`` (no data read)."""
    shape, itemsize = tuple(x.shape), int(np.dtype(x.dtype).itemsize)
    nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
    slot = Slot(name, code, (nbytes,) if raw else shape, nbytes)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        held: dict[Bounds, list[int]] = {}
        for device, index in x.sharding.devices_indices_map(shape).items():
            bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
            held.setdefault(bounds, []).append(group.process_of(device))
        owned = plan_parts(where, shape, held, load)
    else:  # a host array (or one this process holds whole): one part
        owned = plan_parts(
            where, shape, {tuple((0, n) for n in shape): list(range(group.count))}, load
        )
    parts = tuple(Part(bounds, owner, None) for bounds, owner in owned)
    return Spread(slot, x, shape, itemsize, parts)


class Options(NamedTuple):
    """What a save of several processes needs besides the tree.

    ``directory``: ``path`` is a directory of Hugging Face's sharded layout (``FileOut``
    names, an index), not one file.
    """

    path: str
    timeout: float
    directory: bool = False


class FileOut(NamedTuple):
    """One safetensors file of a save: its name in the directory, its tensors and metadata."""

    name: str
    tensors: list[Spread]
    meta: dict[str, str]


class Plan(NamedTuple):
    """What ``build`` gives :func:`save_together`.

    The files, the facts every process must agree on, and the index file (name and
    text) of the directory layout.
    """

    files: list[FileOut]
    facts: dict[str, str]
    index_file: tuple[str, str] | None = None
