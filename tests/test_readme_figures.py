"""Every figure in README.md's benchmark paragraph is a value of the newest recorded run.

``python -m benchmarks readme`` writes the paragraph (benchmarks/readme.py); here it
must be the one the newest full run in benchmarks/results/ gives, and, checked
without the writer, each number in it must be a value of the JSON file it cites.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import readme  # noqa: E402

README = ROOT / "README.md"


def _block() -> str:
    text = README.read_text()
    return text.split(readme.BEGIN)[1].split(readme.END)[0]


def test_the_benchmark_paragraph_is_the_newest_runs():
    newest = readme.newest_run()
    text = readme.paragraph(json.loads(newest.read_text()), newest.name)
    assert readme.render(README.read_text(), text) == README.read_text(), (
        f"README.md's benchmark paragraph is not the one from {newest.name}: "
        "run `python -m benchmarks readme`"
    )


def _candidates(results: dict) -> list[float]:
    """Every value a figure may quote: targets, row seconds and ratios, and their ratios."""
    values = [t["value"] for t in results["targets"]] + [t["limit"] for t in results["targets"]]
    groups: dict = {}
    for r in results["rows"]:
        values += [r["seconds"], r["ratio"]]
        if r["measure"] == "eager flatten":  # the floor concatenate against ravel_pytree
            groups.setdefault((r["leaves"], r["measure"]), []).append(r["seconds"])
    for s in results["sections"]:
        numbers = [v for v in s["info"].values() if isinstance(v, (int, float))]
        if s["name"] == "bytes":  # an untied copy's bytes against the unique bytes
            groups.setdefault(("info", s["name"], s["leaves"]), []).extend(numbers)
        values += numbers
    for group in groups.values():
        values += [a / b for a, b in itertools.permutations(group, 2) if b]
    return values


def test_each_quoted_figure_is_a_value_of_the_json_it_cites():
    block = _block()
    (name,) = set(re.findall(r"benchmarks/results/([\w.-]+\.json)", block))
    results = json.loads((ROOT / "benchmarks" / "results" / name).read_text())
    candidates = _candidates(results)
    figures = re.findall(r"(?<![\w.])(\d+(?:\.\d+)?)(x| s\b)", block)
    assert len(figures) >= 20, figures
    for figure, _ in figures:
        decimals = len(figure.split(".")[1]) if "." in figure else 0
        if decimals == 0:  # sizes and limits ("700 leaves", "10x") are checked below
            continue
        assert any(round(v, decimals) == float(figure) for v in candidates), (
            f"{figure} in README.md is no value of {name}"
        )
    for limit in re.findall(r"at (?:most|least) ([\d.]+)x", block):
        assert float(limit) in {t["limit"] for t in results["targets"]}
    assert f"jax {results['machine']['versions']['jax']}" in block
    assert f"On {results['machine']['cores']} shared CPU cores" in block


def test_every_results_file_the_readme_names_exists():
    for name in re.findall(r"(\d{4}-\d{2}-\d{2}[\w-]*\.json)", README.read_text()):
        assert (ROOT / "benchmarks" / "results" / name).exists(), name
