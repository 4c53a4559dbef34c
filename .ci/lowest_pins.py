"""The lowest declared versions of sharetree's dependencies, read from pyproject.toml.

Usage (from the repository root, with Python >= 3.11 for tomllib):

    python .ci/lowest_pins.py            # print pip constraints: one ``name==floor`` a line
    python .ci/lowest_pins.py --check    # exit 1 unless the installed versions are those floors

Every package in ``PINNED`` must be declared as exactly ``name>=X`` (no upper bound,
no marker) everywhere pyproject mentions it (``dependencies`` and every extra), with
the same ``X`` each time; anything else is an error, so a floor cannot be changed in
one place and forgotten in another. The CI's lowest-versions job installs ``.[test]``
under these constraints and runs the tests there. Add a package to ``PINNED`` when a
new extra brings a dependency whose floor should be tested too.
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

PINNED = (
    "jax",
    "jaxlib",
    "numpy",
    "flax",
    "optax",
    "equinox",
    "safetensors",
    "orbax-checkpoint",
    "chex",
    "treescope",
    "tqdm",
    "torch",
    "transformers",
    "peft",
)

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(.*?)\s*$")
_FLOOR = re.compile(r"^>=\s*([0-9][0-9A-Za-z.+!-]*)$")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def floors(pyproject: Path = PYPROJECT) -> dict[str, str]:
    """``{name: floor}`` for every package in ``PINNED``; raises ``SystemExit`` on a mismatch."""
    project = tomllib.loads(pyproject.read_text())["project"]
    groups = {"dependencies": project.get("dependencies", [])}
    for extra, reqs in project.get("optional-dependencies", {}).items():
        groups[f"optional-dependencies.{extra}"] = reqs
    wanted = {_norm(n): n for n in PINNED}
    found: dict[str, dict[str, str]] = {}  # name -> {where: floor}
    errors = []
    malformed = set()
    for where, reqs in groups.items():
        for req in reqs:
            m = _REQ.match(req)
            if m is None or _norm(m.group(1)) not in wanted:
                continue
            name = wanted[_norm(m.group(1))]
            floor = _FLOOR.match(m.group(2))
            if floor is None:
                errors.append(f"{where}: {req!r} is not of the form '{name}>=X'")
                malformed.add(name)
                continue
            found.setdefault(name, {})[where] = floor.group(1)
    for name in PINNED:
        seen = found.get(name, {})
        if not seen and name not in malformed:
            errors.append(f"{name} is pinned in .ci/lowest_pins.py but pyproject never declares it")
        elif len(set(seen.values())) > 1:
            errors.append(f"{name} has different floors: {seen}")
    if errors:
        raise SystemExit("lowest_pins: " + "; ".join(errors) + f" ({pyproject})")
    return {name: next(iter(found[name].values())) for name in PINNED}


def check(pins: dict[str, str]) -> list[str]:
    """Installed packages whose version is not their floor, as messages."""
    bad = []
    for name, floor in pins.items():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            bad.append(f"{name}: not installed (expected {floor})")
            continue
        if have.split("+")[0] != floor:  # a local build (torch 2.13.0+cpu) is that version
            bad.append(f"{name}: installed {have}, expected {floor}")
    return bad


def main(argv: list[str]) -> int:
    """Print the constraints, or with ``--check`` compare them with what is installed."""
    pins = floors()
    if argv == ["--check"]:
        bad = check(pins)
        for line in bad:
            print(f"lowest_pins: {line}", file=sys.stderr)
        if not bad:
            print("lowest_pins: installed " + ", ".join(f"{n}=={v}" for n, v in pins.items()))
        return 1 if bad else 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    for name, floor in pins.items():
        print(f"{name}=={floor}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
