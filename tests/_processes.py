"""``run_processes(n, fn)``: ``fn(i)`` as ``n`` simulated processes of one job (threads).

Each thread joins one ``sharetree._files.processes.ThreadGroup`` (a shared dict as the
coordination service's key-value store), so ``st.save`` on several "processes" runs
its rounds in one test process. ``tests/test_multihost.py`` runs real processes.
"""

from __future__ import annotations

import threading
from typing import Any

from sharetree._files import processes


def run_processes(n: int, fn: Any, timeout: float = 60.0) -> list[Any]:
    """``fn(i)`` in ``n`` threads joined to one simulated job: each result or exception."""
    store = processes.ThreadGroup.store()
    out: list[Any] = [None] * n

    def one(i: int) -> None:
        with processes.joined(processes.ThreadGroup(i, n, store)):
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
