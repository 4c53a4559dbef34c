"""Peak anonymous memory of this process while a block runs (``RssAnon``, sampled on a thread).

File-backed pages (the page cache of a memory-mapped file) are not counted:
``RssAnon`` is the memory a loader allocates. Used by the loading tests and
benchmarks, each in a fresh process.
"""

from __future__ import annotations

import ctypes
import threading
import time

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def fixed_mmap_threshold(nbytes: int = 128 << 10) -> None:
    """Serve every allocation above ``nbytes`` by its own mmap, returned to the OS when freed.

    glibc raises its threshold each time such a block is freed, and later
    blocks then come from a heap that keeps freed memory: a measurement after
    a warm-up would count less than was allocated. A fixed threshold stops that.
    """
    ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, nbytes)


def rss_anon() -> int:
    """Bytes of anonymous resident memory of this process (Linux ``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (not Linux?)")


class PeakAnon:
    """``with PeakAnon() as m: ...``; then ``m.growth``: peak ``RssAnon`` minus the start, bytes."""

    def __init__(self, interval: float = 0.0005) -> None:
        fixed_mmap_threshold()
        self.interval = interval
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(self.interval)

    def __enter__(self) -> PeakAnon:
        self.start = self.peak = rss_anon()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())

    @property
    def growth(self) -> int:
        return self.peak - self.start
