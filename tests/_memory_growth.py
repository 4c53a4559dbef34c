"""Run in a fresh process: the growth of anonymous memory over many eager materializes.

``python tests/_memory_growth.py COUNT [--leaky]`` fills sharetree's caches to their
bounds, reads ``RssAnon`` (the process's anonymous memory now, not its peak) from
``/proc/self/status``, materializes ``COUNT`` new structures with 20 views each (each
compiles one program for its views), reads it again and prints both as JSON.
``--leaky`` first replaces the bounded cache of compiled programs by an unbounded one
(every structure keeps its program), the leak the test must be able to see.
"""

from __future__ import annotations

import functools
import gc
import json
import sys

import numpy as np

import sharetree as st
from sharetree import _materialize


def rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise RuntimeError("no RssAnon line in /proc/self/status")


def run(count: int, offset: int) -> int:
    for n in range(offset, offset + count):
        tree = {f"w{n}": np.ones((4, 4), np.float32)}
        tree.update({f"v{i}_{n}": st.Tied(f"w{n}", st.T) for i in range(20)})
        st.materialize(tree)
    gc.collect()
    return rss_anon_kib()


def keep_every_program() -> None:
    """Replace the bounded cache of compiled programs by an unbounded one (a leak)."""
    unbounded = functools.lru_cache(maxsize=None)(_materialize._eager_views.__wrapped__)
    _materialize._eager_views = unbounded


def main(argv: list[str]) -> None:
    count = int(argv[0])
    if "--leaky" in argv:
        keep_every_program()
    run(_materialize.EAGER_PROGRAM_CACHE_SIZE + 20, 0)  # warm up: caches fill to their bounds
    before = run(20, 10_000)
    after = run(count, 20_000)
    print(json.dumps({"before_kib": before, "after_kib": after}))


if __name__ == "__main__":
    main(sys.argv[1:])
