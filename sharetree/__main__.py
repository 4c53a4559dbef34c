"""Command line: ``python -m sharetree demo`` and ``python -m sharetree inspect FILE``.

``demo`` trains the tied character-level language model of ``sharetree._demo``
and prints its sharing summary and a sample; ``--out`` saves a checkpoint.
``inspect`` prints the sharing graph of a checkpoint written by ``sharetree.save``.
Bad arguments and unreadable files: one line on stderr, exit code 2. A reader
that leaves early (``python -m sharetree inspect FILE | head -2``): no
traceback, exit code 141, as a shell reports for a program that SIGPIPE ended.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence
from typing import NoReturn

EXIT_PIPE = 128 + 13  # 128 + SIGPIPE


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line: ``prog: error: message``."""

    def error(self, message: str) -> NoReturn:
        """Print ``message`` on one line of stderr and exit with code 2."""
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")

    def add_count(self, flag: str, metavar: str, minimum: int, default: int, what: str) -> None:
        """Add the option ``flag``: an integer of at least ``minimum`` (``what`` is its help)."""

        def parse(text: str) -> int:
            try:
                n = int(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
            if n < minimum:
                raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {n}")
            return n

        doc = f"{what} (default {default})"
        self.add_argument(flag, type=parse, default=default, metavar=metavar, help=doc)


def _parser() -> _Parser:
    parser = _Parser(
        prog="python -m sharetree",
        description="sharetree: explicit parameter sharing (tied weights) in JAX pytrees.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{demo,inspect}", required=True)
    demo = sub.add_parser(
        "demo",
        help="train a tied character-level language model and show the sharing",
        description="Train a small character-level transformer language model on the text "
        "that ships with sharetree. Its output layer is Tied('embed/embedding', T) and its "
        "second block is Tied('block_0'). Prints the sharing summary and generated text; "
        "--out saves a checkpoint.",
    )
    demo.add_count("--steps", "N", 1, 500, "training steps")
    demo.add_argument("--out", metavar="FILE", help="save the trained tree (.safetensors)")
    demo.add_count("--seed", "S", 0, 0, "random seed")
    demo.add_count("--sample", "N", 0, 200, "characters to generate after training")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.set_defaults(run=functools.partial(_demo, demo))  # its errors name the command
    inspect = sub.add_parser(
        "inspect",
        help="print the sharing graph of a checkpoint saved by sharetree.save",
        description="Print the sharing graph (buffers, views, unique vs expanded counts and "
        "bytes) of a checkpoint written by sharetree.save. Runs no code from the file.",
    )
    inspect.add_argument("file", metavar="FILE", help="the checkpoint (.safetensors)")
    inspect.add_count("--max-rows", "N", 1, 50, "rows per table before cutting")
    inspect.set_defaults(run=functools.partial(_inspect, inspect))
    return parser


def _demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    missing = [m for m in ("flax", "optax", "tqdm") if importlib.util.find_spec(m) is None]
    if missing:
        parser.error(f"the demo needs {', '.join(missing)}: pip install 'sharetree[demo]'")
    out = args.out
    if out is not None:
        parent = os.path.dirname(os.path.abspath(out))
        if os.path.isdir(out):
            parser.error(f"--out {out!r} is a directory; give a file name such as lm.safetensors")
        if not os.path.isdir(parent):
            parser.error(f"--out {out!r}: the directory {parent!r} does not exist")
        if not os.access(parent, os.W_OK):
            parser.error(f"--out {out!r}: the directory {parent!r} is not writable")
    from sharetree import _demo, save
    from sharetree._display import format_bytes

    params = _demo.run(args.steps, seed=args.seed, sample=args.sample, quiet=args.quiet)
    if out is not None:
        try:
            save(out, params)
        except OSError as e:
            parser.error(f"cannot write {out!r}: {e}")
        print()
        print(f"checkpoint: {out} ({format_bytes(os.path.getsize(out))}, each buffer stored once)")
        print(f"            see it with: python -m sharetree inspect {out}")


def _inspect(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from sharetree import TieError
    from sharetree._io import describe  # size and sharing graph, running none of the file's code

    path = args.file
    if not os.path.exists(path):
        parser.error(f"no such file: {path!r}")
    if os.path.isdir(path):
        parser.error(f"{path!r} is a directory, not a checkpoint file")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            text = describe(path, max_rows=args.max_rows)
        except (TieError, OSError) as e:
            parser.error(f"cannot read {path!r}: {e}")
    for w in caught:
        print(f"note: {' '.join(str(w.message).split())}", file=sys.stderr)
    print(text)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on ``argv`` (``sys.argv[1:]`` by default); return the exit code.

    Example:
        >>> from sharetree.__main__ import main
        >>> main(["demo", "--steps", "0"])
        2
    """
    parser = _parser()
    try:
        try:
            args = parser.parse_args(argv)
            args.run(args)
            code = 0
        except SystemExit as e:  # --help (0) and parser.error (2), already printed
            code = int(e.code or 0)
        except KeyboardInterrupt:
            print(f"{parser.prog}: interrupted", file=sys.stderr)
            code = 130
        if sys.stdout is not None:  # None when the process started with stdout closed
            sys.stdout.flush()  # a reader that left shows up here, inside the try
    except BrokenPipeError:
        # https://docs.python.org/3/library/signal.html#note-on-sigpipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE
    return code


if __name__ == "__main__":
    sys.exit(main())
