"""Command line: ``python -m sharetree demo`` and ``python -m sharetree inspect FILE``.

``demo`` trains a small character-level language model whose output
projection is its token embedding transposed and whose second block is its
first (both written as ``Tied`` nodes), then prints the sharing summary, a
sample of generated text, and optionally saves a checkpoint. ``inspect``
prints the sharing graph of a checkpoint written by ``sharetree.save``.
Bad arguments and unreadable files give a one-line error and exit code 2.
When standard output stops taking output (a reader that closed early, as in
``python -m sharetree inspect FILE | head -2``, or a closed stdout), the
command stops quietly with exit code 141, what a shell reports for a program
that SIGPIPE ended (``cat FILE | head -2``), and no traceback.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

EXIT_USAGE = 2
EXIT_STDOUT_GONE = 128 + 13  # 128 + SIGPIPE, as a shell reports for `cat big | head -1`


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line: ``prog: error: message``."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {_one_line(message)} (see --help)\n")


class _UsageError(Exception):
    """A problem with the user's input: printed as one line, exit code 2."""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _positive(name: str, minimum: int) -> Any:
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {n}")
        return n

    parse.__name__ = name
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m sharetree``."""
    parser = _Parser(
        prog="python -m sharetree",
        description="sharetree: explicit parameter sharing (tied weights) in JAX pytrees.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{demo,inspect}", required=True)
    demo = sub.add_parser(
        "demo",
        help="train a tied character-level language model and show the sharing",
        description=(
            "Train a small character-level transformer language model on the text that "
            "ships with sharetree. Its output projection is Tied('embed/tokens', T) and its "
            "second block is Tied('blocks/0'). Prints the sharing summary (unique vs "
            "expanded parameters, memory saved) and generated text; --out saves a checkpoint."
        ),
    )
    demo.add_argument(
        "--steps",
        type=_positive("steps", 1),
        default=500,
        metavar="N",
        help="training steps (default 500: about 30 s on 2 CPU cores)",
    )
    demo.add_argument(
        "--out",
        metavar="FILE",
        help="save the trained canonical tree with sharetree.save (a .safetensors file)",
    )
    demo.add_argument(
        "--seed", type=_positive("seed", 0), default=0, metavar="S", help="random seed (default 0)"
    )
    demo.add_argument(
        "--sample",
        type=_positive("sample", 0),
        default=200,
        metavar="N",
        help="characters to generate after training (default 200)",
    )
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    inspect = sub.add_parser(
        "inspect",
        help="print the sharing graph of a checkpoint saved by sharetree.save",
        description="Print the sharing graph (buffers, views, unique vs expanded counts and "
        "bytes) of a checkpoint written by sharetree.save.",
    )
    inspect.add_argument("file", metavar="FILE", help="the checkpoint (.safetensors)")
    inspect.add_argument(
        "--max-rows",
        type=_positive("max-rows", 1),
        default=50,
        metavar="N",
        help="rows per table before cutting (default 50)",
    )
    return parser


def _progress_bar(steps: int, quiet: bool) -> tuple[Any, Any]:
    """``(update(step, loss), close())`` of a tqdm bar (a plain fallback without tqdm)."""
    if quiet:
        return (lambda i, loss: None), (lambda: None)
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the demo extra
        every = max(1, steps // 10)

        def update(i: int, loss: float) -> None:
            if i % every == 0 or i == steps - 1:
                print(f"step {i + 1}/{steps}  loss {loss:.3f}", file=sys.stderr)

        return update, (lambda: None)
    bar = tqdm(total=steps, desc="training", unit="step", file=sys.stderr, mininterval=0.25)
    ema: list[float] = []

    def update(i: int, loss: float) -> None:
        ema.append(loss if not ema else 0.9 * ema[-1] + 0.1 * loss)
        bar.update(1)
        if i % 5 == 0 or i == steps - 1:
            bar.set_postfix(loss=f"{ema[-1]:.3f}", refresh=False)

    return update, bar.close


def _check_out(path: str) -> None:
    if os.path.isdir(path):
        raise _UsageError(
            f"--out {path!r} is a directory; give a file name such as model.safetensors"
        )
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise _UsageError(f"--out {path!r}: the directory {parent!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise _UsageError(f"--out {path!r}: the directory {parent!r} is not writable")


def _demo(args: argparse.Namespace) -> int:
    if args.out is not None:
        _check_out(args.out)
    try:
        import optax  # noqa: F401
    except ImportError:
        raise _UsageError(
            "the demo needs optax; install it with: pip install 'sharetree[demo]'"
        ) from None
    import sharetree as st
    from sharetree import _demo
    from sharetree._display import format_bytes, saved_percent

    cfg = _demo.Config()
    text = _demo.load_corpus()
    print("sharetree demo: a character-level transformer language model with tied weights")
    print(f"  corpus   {len(text):,} characters of sharetree/data/corpus.txt")
    print("  ties     head/kernel = Tied('embed/tokens', T)   output projection = embedding.T")
    print("           blocks/1    = Tied('blocks/0')          one block applied twice (ALBERT)")
    sys.stdout.flush()
    update, close = _progress_bar(args.steps, args.quiet)
    try:
        result = _demo.train(args.steps, seed=args.seed, cfg=cfg, text=text, progress=update)
    finally:
        close()
    params = result.params
    print(
        f"held-out loss {result.initial_eval:.3f} -> {result.final_eval:.3f} nats/char "
        f"after {args.steps} steps ({result.seconds:.1f} s, compilation included)"
    )
    print()
    g = st.canonicalize(params)
    print(st.summary(g))
    print()
    saved = g.size_expanded - g.size_unique
    print(
        f"parameters: {g.size_unique:,} unique vs {g.size_expanded:,} expanded: sharing saves "
        f"{saved:,} parameters ({saved_percent(g.size_unique, g.size_expanded):.1f}%), "
        f"{format_bytes(g.nbytes_expanded - g.nbytes_unique)} of float32"
    )
    print(
        f"optimizer:  Adam holds {result.opt_state_size:,} floats (2 per unique parameter), "
        f"not {2 * g.size_expanded:,}"
    )
    if args.sample:
        prompt = "The well "
        sample = _demo.generate(params, result.vocab, cfg, prompt, args.sample, seed=args.seed)
        print()
        print("sample (temperature 0.8):")
        for line in (prompt + sample).splitlines() or [""]:
            print(f"  {line}")
    if args.out is not None:
        try:
            st.save(args.out, params)
        except OSError as e:
            raise _UsageError(f"cannot write {args.out!r}: {e}") from None
        size = os.path.getsize(args.out)
        print()
        print(f"checkpoint: {args.out} ({format_bytes(size)}, each shared buffer stored once)")
        print(f"            see it with: python -m sharetree inspect {args.out}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    import sharetree as st

    path = args.file
    if not os.path.exists(path):
        raise _UsageError(f"no such file: {path!r}")
    if os.path.isdir(path):
        raise _UsageError(f"{path!r} is a directory, not a checkpoint file")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            tree = st.load(path)
            text = st.summary(tree, max_rows=args.max_rows)
        except (st.TieError, OSError) as e:
            raise _UsageError(f"cannot read {path!r}: {e}") from None
        except Exception as e:  # a damaged file can fail in any parser: say so in one line
            raise _UsageError(f"cannot read {path!r}: {type(e).__name__}: {e}") from None
    for w in caught:
        print(f"note: {_one_line(str(w.message))}", file=sys.stderr)
    print(f"{path}: {os.path.getsize(path):,} bytes")
    print(text)
    return 0


def _stdout_gone(error: BaseException) -> bool:
    """Whether ``error`` means stdout takes no more output (its reader left, or it is closed)."""
    if isinstance(error, BrokenPipeError):
        return True
    out = sys.stdout
    if out is None:
        return False
    if isinstance(error, ValueError):  # "I/O operation on closed file"
        return bool(getattr(out, "closed", False))
    if isinstance(error, OSError) and error.errno == errno.EBADF:
        try:
            os.fstat(out.fileno())
        except OSError:
            return True  # the descriptor behind stdout is closed
        except ValueError:  # pragma: no cover - fileno of a closed stream
            return True
    return False


def _discard_stdout() -> None:
    """Point stdout's descriptor at ``os.devnull``, so that the final flush cannot fail again.

    This is the recipe of https://docs.python.org/3/library/signal.html#note-on-sigpipe:
    whatever is still buffered goes nowhere instead of raising at interpreter exit.
    """
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # closed, or not a file (io.StringIO)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (``sys.argv[1:]`` by default); return the exit code.

    Example:
        >>> from sharetree.__main__ import main
        >>> main(["demo", "--steps", "0"])
        2
    """
    parser = build_parser()
    try:
        code = _run(parser, argv)
        if sys.stdout is not None:
            sys.stdout.flush()  # a reader that left shows up here, not at interpreter exit
        return code
    except (OSError, ValueError) as e:
        if not _stdout_gone(e):
            raise
        _discard_stdout()  # the reader closed early (| head): stop quietly, no traceback
        return EXIT_STDOUT_GONE


def _run(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    try:
        args = parser.parse_args(argv)
        if args.command == "demo":
            return _demo(args)
        return _inspect(args)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2, already printed)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    except _UsageError as e:
        print(f"{parser.prog} {args.command}: error: {_one_line(str(e))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
