"""Timing helpers: interleaved medians, AOT compile timing, machine description."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

_COMPILER_OPTIONS: dict[str, Any] | None = None


@contextlib.contextmanager
def compiler_options(options: dict[str, Any] | None) -> Iterator[None]:
    """Compile with these XLA options inside the block (the smoke mode uses ``-O0``)."""
    global _COMPILER_OPTIONS
    saved, _COMPILER_OPTIONS = _COMPILER_OPTIONS, options
    try:
        yield
    finally:
        _COMPILER_OPTIONS = saved


def _block(x: Any) -> Any:
    return jax.block_until_ready(x)


def interleaved(
    fns: dict[str, Callable[[], Any]], rounds: int, warmup: int = 1
) -> dict[str, float]:
    """Median seconds of each zero-argument callable, measured in interleaved rounds.

    Each round runs every callable once, in an order rotated from round to round,
    so that slow drift of a shared machine (other processes, thermal state) hits
    every method alike and cancels out of the ratios.
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            _block(fns[name]())
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(max(1, rounds)):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            _block(fns[name]())
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def fresh(f: Callable[..., Any]) -> Callable[..., Any]:
    """A new function object with ``f``'s behaviour: ``jax.jit`` of it shares no cache."""

    def g(*args: Any) -> Any:
        return f(*args)

    return g


def compile_times(
    make: dict[str, Callable[[], Callable[..., Any]]],
    args: dict[str, Sequence[Any]],
    repeats: int | dict[str, int],
    cpu_samples: dict[str, list[float]] | None = None,
) -> tuple[dict[str, float], dict[str, float], dict[str, Any], dict[str, list[float]]]:
    """Median lowering and compile seconds of ``jit(make[name]())`` at ``args[name]``.

    Every repeat jits a fresh function object, so JAX's tracing, lowering and
    compilation caches are all missed; methods are interleaved as in
    :func:`interleaved`. Compilation is measured ahead of time:
    ``jax.jit(f).lower(*args)`` (lowering) then ``.compile()`` (XLA).
    ``repeats`` may differ per method (a dict), e.g. to repeat only the
    comparisons that matter when each compile takes minutes. ``cpu_samples``,
    if given, receives the CPU seconds of this process for each compile (all
    threads: less sensitive than wall time to other jobs on a shared machine).

    Returns:
        ``(lower_s, compile_s, compiled, samples)``: medians per method, the last
        compiled executable of each (for the run timings) and every compile time.
    """
    names = list(make)
    reps = repeats if isinstance(repeats, dict) else dict.fromkeys(names, repeats)
    lower: dict[str, list[float]] = {n: [] for n in names}
    comp: dict[str, list[float]] = {n: [] for n in names}
    compiled: dict[str, Any] = {}
    for r in range(max(1, *reps.values())):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            if comp[name] and r >= reps.get(name, 1):
                continue
            f = fresh(make[name]())
            t0 = time.perf_counter()
            lowered = jax.jit(f).lower(*args[name])
            t1, c1 = time.perf_counter(), time.process_time()
            compiled[name] = (
                lowered.compile(_COMPILER_OPTIONS) if _COMPILER_OPTIONS else lowered.compile()
            )
            t2, c2 = time.perf_counter(), time.process_time()
            lower[name].append(t1 - t0)
            comp[name].append(t2 - t1)
            if cpu_samples is not None:
                cpu_samples.setdefault(name, []).append(c2 - c1)
    med = statistics.median
    return (
        {n: med(v) for n, v in lower.items()},
        {n: med(v) for n, v in comp.items()},
        compiled,
        comp,
    )


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def machine_info() -> dict[str, Any]:
    """CPU, cores, load, library versions and platform of this run."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    dev = jax.devices()[0]
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "loadavg_start": _load(),
        "backend": jax.default_backend(),
        "device": f"{dev.platform}:{getattr(dev, 'device_kind', '')}",
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": {
            name: _version(name)
            for name in ("jax", "jaxlib", "numpy", "flax", "optax", "equinox", "sharetree")
        },
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (``None`` where unknown)."""
    return _load()


def fmt_seconds(s: float | None) -> str:
    """``1.23 s``, ``12.3 ms`` or ``45 µs``."""
    if s is None:
        return "-"
    if s >= 1.0:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms" if s < 0.1 else f"{s * 1e3:.0f} ms"
    return f"{s * 1e6:.3g} µs"
