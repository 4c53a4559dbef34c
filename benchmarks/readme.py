"""The README's benchmark paragraph, written from the newest recorded full run.

``python -m benchmarks readme`` rewrites the text between the ``benchmarks: begin``
and ``benchmarks: end`` markers of README.md from the newest full run in
``benchmarks/results/`` (``--check``: exit 1 if the README differs, rewriting
nothing). Every figure in the paragraph is a value of that JSON file, rounded; a
figure that misses what we aimed for says so next to it. A full run is one of
the whole suite (not ``--quick``, with the flat-path and LM sections); partial
runs (one section, other helpers' extra rows) are skipped, and rows or targets
the paragraph does not quote are ignored.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
BEGIN = "<!-- benchmarks: begin (python -m benchmarks readme writes this from the newest run) -->"
END = "<!-- benchmarks: end -->"
SIZES = (700, 2000)  # the README quotes these two tree sizes
LARGE = 10000
WIDTH = 88
PLAIN_TIME = "the plain tree's time"

ST_CLOSED = "sharetree: loss . restructure (closed over)"
ST_ARG = "sharetree: loss . restructure (argument)"
RAVEL = "ravel_pytree: loss . unravel (views by hand)"


def is_full_run(results: dict[str, Any]) -> bool:
    """A run of the whole suite at the README's sizes (not --quick, not one section)."""
    config = results.get("config") or {}
    names = {s.get("name") for s in results.get("sections", [])}
    return (
        config.get("quick") is False
        and set(SIZES) <= set(config.get("sizes") or ())
        and LARGE in (config.get("eager_tree_sizes") or ())
        and {"jit(grad)", "eager flatten", "eager tree ops", "transformer LM"} <= names
    )


def newest_run(folder: Path = RESULTS) -> Path:
    """The newest full run in ``folder``, by the date the run recorded."""
    runs = []
    for path in sorted(folder.glob("*.json")):
        results = json.loads(path.read_text())
        if is_full_run(results):
            runs.append((results["machine"]["date"], path.name, path))
    if not runs:
        raise SystemExit(f"benchmarks readme: no full run in {folder}")
    return max(runs)[2]


class Figures:
    """Look-ups into one results file; a missing row or target is an error naming it."""

    def __init__(self, results: dict[str, Any]) -> None:
        self.results = results

    def target(self, name: str, leaves: int | None) -> dict[str, Any]:
        for t in self.results["targets"]:
            if t["target"] == name and t["leaves"] == leaves:
                return t
        raise KeyError(f"no target {name!r} at {leaves} leaves")

    def seconds(self, measure: str, method: str, leaves: int | None) -> float:
        for r in self.results["rows"]:
            if r["measure"] == measure and r["method"] == method and r["leaves"] == leaves:
                return float(r["seconds"])
        raise KeyError(f"no row {measure!r} / {method!r} at {leaves} leaves")

    def info(self, section: str, key: str, leaves: int | None) -> Any:
        for s in self.results["sections"]:
            if s["name"] == section and s["leaves"] == leaves and key in s["info"]:
                return s["info"][key]
        raise KeyError(f"no {key!r} in section {section!r} at {leaves} leaves")


def x(value: float) -> str:
    """A ratio as the README writes it."""
    return f"{value:.1f}x" if value >= 10 else f"{value:.2f}x"


def span(values: list[float], fmt: Any = x) -> str:
    lo, hi = min(values), max(values)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo).rstrip('x')}-{fmt(hi)}"


def aim(t: dict[str, Any]) -> str:
    """What we aimed for, and whether this run reached it, in plain words."""
    bound = "at most" if t["op"] == "<=" else "at least"
    verdict = "reached" if t["met"] else "not reached"
    exact = f"{t['value']:.3f}x; " if x(t["value"]) == x(t["limit"]) else ""  # 1.024x vs 1.02x
    return f"({exact}we aim for {bound} {t['limit']:g}x: {verdict})"


def paragraph(results: dict[str, Any], name: str) -> str:
    """The benchmark paragraph of README.md from one results file."""
    f = Figures(results)
    small, big = SIZES
    versions = results["machine"]["versions"]
    unique = [f.info("bytes", "num_unique", n) for n in SIZES]

    def t(target: str, n: int | None) -> dict[str, Any]:
        return f.target(target, n)

    closed_ravel = [
        t("compile: sharetree restructure (closed over) / ravel_pytree", n) for n in SIZES
    ]
    arg_ravel = [t("compile: sharetree restructure (argument) / ravel_pytree", n) for n in SIZES]
    closed_floor = [t("compile: sharetree restructure (closed over) / floor", n) for n in SIZES]
    run_floor = [t("run: sharetree restructure (closed over) / floor", n) for n in SIZES]
    vmap = [t("vmap: per-vector time / single call", n)["value"] for n in SIZES]
    lm_run = t("LM step run: sharetree / by hand", None)
    lm_compile = t("LM step compile: sharetree / by hand", None)
    first = [
        t("eager destructure, first call: ravel_pytree / sharetree (speed-up)", n) for n in SIZES
    ]
    repeated = [t("eager destructure: ravel_pytree / sharetree (speed-up)", n) for n in SIZES]
    concat = [
        f.seconds("eager flatten", "ravel_pytree", n)
        / f.seconds("eager flatten", "floor: one jitted concatenate of the buffers", n)
        for n in SIZES
    ]
    untied = [
        f.info("bytes", "nbytes Adam state untied (mu + nu)", n)
        / f.info("bytes", "nbytes Adam state (mu + nu)", n)
        for n in SIZES
    ]
    grad_bytes = [t("bytes: gradient / unique", n) for n in SIZES]
    adam_bytes = [t("bytes: Adam mu+nu / (2 x unique)", n) for n in SIZES]
    exact = all(b["value"] == 1.0 for b in grad_bytes + adam_bytes)
    materialize = t("eager materialize / tree.map(identity)", LARGE)
    views_alone = f.seconds(
        "eager (2nd call)", "floor part: the views alone, one jitted call", LARGE
    ) / f.seconds("eager (2nd call)", "jax.tree.map(lambda x: x)", LARGE)
    materialize_sizes = [t("eager materialize / tree.map(identity)", n)["value"] for n in SIZES]

    def s(value: float) -> str:
        return f"{value:.1f} s"

    def fold(ts: list[dict[str, Any]], what: str) -> str:  # "0.30x WHAT at 700 leaves and ..."
        return f"{x(ts[0]['value'])} {what} at {small:,} leaves and {x(ts[1]['value'])} at {big:,}"

    def aims(ts: list[dict[str, Any]]) -> str:
        return (
            aim(ts[-1])
            if all(tt["met"] for tt in ts)
            else aim(next(tt for tt in ts if not tt["met"]))
        )

    bullets = [
        f"On {results['machine']['cores']} shared CPU cores (`benchmarks/results/{name}`, "
        f"jax {versions['jax']}; {small:,} and {big:,} leaves, {unique[0]:,} and "
        f"{unique[1]:,} unique buffers):",
        "- `jax.jit(jax.grad(lambda v: loss(restructure(v))))`, with `restructure` **closed "
        f"over** as users write it, compiles in {fold(closed_ravel, 'the time of `ravel_pytree`')}"
        f" ({s(f.seconds('compile', ST_CLOSED, big))} against "
        f"{s(f.seconds('compile', RAVEL, big))}), and in "
        f"{fold(closed_floor, 'the time of the same gradient of the plain tree')} "
        f"{aims(closed_floor)}; it runs in {fold(run_floor, PLAIN_TIME)}. "
        f"Passed to `jit` as an argument it compiles in "
        f"{fold(arg_ravel, 'the time of `ravel_pytree`')}. Under `jit` on CPU it cuts "
        "the vector at offsets XLA cannot fold into constants, so cuts of equal shape share "
        "one kernel.",
        f"- `vmap(restructure)` costs {span(vmap)} per vector of one call; "
        + (
            "the gradient and the Adam state hold exactly the unique bytes"
            if exact
            else "the gradient and the Adam state hold more than the unique bytes"
        )
        + f" (an untied copy holds {span(untied)}); a tied-embedding LM train step runs in "
        f"{x(lm_run['value'])} the time of the model tied by hand with `nn.Embed.attend` "
        f"{aim(lm_run)} and compiles in {x(lm_compile['value'])}.",
        f"- Eager `destructure` is {span([t['value'] for t in first])} faster than "
        "`ravel_pytree` on the first call for a structure and "
        f"{span([t['value'] for t in repeated])} on repeated calls {aims(repeated)}; one "
        "precompiled concatenate of the already-flattened buffers, the least any flatten "
        f"costs, is {span(concat)} faster than `ravel_pytree` here.",
        f"- Eager `materialize` takes {span(materialize_sizes)} the time of "
        f"`jax.tree.map(lambda x: x)` at {small:,}-{big:,} leaves and "
        f"{x(materialize['value'])} at {LARGE:,} {aim(materialize)}; the views alone, "
        f"computed by one compiled call, take {x(views_alone)}.",
    ]
    head, *items = bullets
    out = textwrap.fill(head, WIDTH) + "\n\n"
    for item in items:
        out += textwrap.fill(item, WIDTH, subsequent_indent="  ", break_on_hyphens=False) + "\n"
    return out


def render(readme: str, text: str) -> str:
    """``readme`` with the text between the markers replaced by ``text``."""
    if readme.count(BEGIN) != 1 or readme.count(END) != 1:
        raise SystemExit(f"README.md: expected one {BEGIN!r} and one {END!r}")
    head, rest = readme.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{text}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks readme", description=__doc__)
    p.add_argument("--check", action="store_true", help="exit 1 if README.md is not up to date")
    args = p.parse_args(argv)
    path = newest_run()
    text = paragraph(json.loads(path.read_text()), path.name)
    old = README.read_text()
    new = render(old, text)
    if args.check:
        if new != old:
            print(
                f"README.md's benchmark paragraph is not the one from {path.name}", file=sys.stderr
            )
            return 1
        return 0
    README.write_text(new)
    print(f"README.md: benchmark paragraph from {path.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
