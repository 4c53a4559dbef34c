"""Check the built sdist and wheel of sharetree: the wheel holds the package and nothing else.

Usage (from the repository root, after ``python -m build --outdir DIST``):

    python .ci/check_dist.py DIST

The wheel must contain every module of ``sharetree/`` that git tracks, ``py.typed``
and the demo's corpus under ``sharetree/data/``, plus its ``.dist-info``; no tests,
benchmarks, notebooks, docs, examples or caches. The sdist must hold the package,
pyproject.toml, README.md and LICENSE. Exit 1 with every problem listed.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def tracked_package_files() -> set[str]:
    """Files git tracks under sharetree/ (what the wheel must ship)."""
    out = subprocess.run(
        ["git", "ls-files", "sharetree"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return {line for line in out.splitlines() if line}


def check_wheel(wheel: Path, expected: set[str]) -> list[str]:
    """Problems with the wheel's file list (empty when it is right)."""
    names = set(zipfile.ZipFile(wheel).namelist())
    info = {n for n in names if n.split("/", 1)[0].endswith(".dist-info")}
    package = names - info
    problems = [f"wheel lacks {n}" for n in sorted(expected - package)]
    problems += [f"wheel holds {n}, which is not a tracked package file" for n in
                 sorted(package - expected)]  # fmt: skip
    for needed in ("sharetree/py.typed", "sharetree/data/corpus.txt", "sharetree/__init__.py"):
        if needed not in names:
            problems.append(f"wheel lacks {needed}")
    for n in names:
        top = n.split("/", 1)[0]
        if top != "sharetree" and not top.endswith(".dist-info"):
            problems.append(f"wheel holds {n} outside sharetree/")
        if "__pycache__" in n or n.endswith(".pyc"):
            problems.append(f"wheel holds a cache file {n}")
    for meta in ("METADATA", "WHEEL", "RECORD", "licenses/LICENSE"):
        if not any(n.endswith(f".dist-info/{meta}") for n in info):
            problems.append(f"wheel lacks .dist-info/{meta}")
    return problems


def check_sdist(sdist: Path) -> list[str]:
    """Problems with the sdist (empty when it holds what a build from it needs)."""
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    needed = ["pyproject.toml", "README.md", "LICENSE", "sharetree/__init__.py",
              "sharetree/py.typed", "sharetree/data/corpus.txt"]  # fmt: skip
    return [f"sdist lacks {n}" for n in needed if n not in names]


def main(dist: str) -> int:
    """Check the one wheel and one sdist in ``dist``; print the problems; exit code."""
    wheels = sorted(Path(dist).glob("sharetree-*.whl"))
    sdists = sorted(Path(dist).glob("sharetree-*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        print(f"check_dist: expected one wheel and one sdist in {dist}, found "
              f"{[p.name for p in wheels + sdists]}")  # fmt: skip
        return 1
    expected = tracked_package_files()
    problems = check_wheel(wheels[0], expected) + check_sdist(sdists[0])
    problems = list(dict.fromkeys(problems))  # one line per problem
    for p in problems:
        print(f"check_dist: {p}")
    if not problems:
        n = len(zipfile.ZipFile(wheels[0]).namelist())
        print(f"check_dist: {wheels[0].name}: {n} files, the package and its metadata only")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
