"""``python -m benchmarks``: run the suite (see ``benchmarks/run.py`` for the options).

``python -m benchmarks readme [--check]`` writes (or checks) README.md's benchmark
paragraph from the newest recorded run (``benchmarks/readme.py``).
"""

import sys

if sys.argv[1:2] == ["readme"]:
    from benchmarks.readme import main as readme

    raise SystemExit(readme(sys.argv[2:]))

from benchmarks.run import main

raise SystemExit(main())
