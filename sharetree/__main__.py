"""``python -m sharetree demo`` and ``inspect FILE``: see "Command line" in docs/display.md."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence
from typing import NoReturn

from sharetree._display import summary
from sharetree._errors import TieError, add_context, bounded, error, one_line
from sharetree._files.container import Reader
from sharetree._files.disk import PathOrStr, file_path
from sharetree._files.format import KEY_LIBRARY, KEY_VERSION
from sharetree._files.hf import checkpoint_readers
from sharetree._files.load import read_contents
from sharetree._files.save import save
from sharetree._files.suggest import suggest_ties
from sharetree._materialize import leaves_and_structure
from sharetree._paths import key_str
from sharetree._report import SharingGraph
from sharetree._tables import check_max_rows, format_bytes, more_line, printable, text_table
from sharetree._transforms import identity, is_described

EXIT_PIPE = 128 + 13  # 128 + SIGPIPE


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line: ``prog: error: message``."""

    def error(self, message: str) -> NoReturn:
        """Print ``message`` on one line of stderr and exit with code 2."""
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")

    def add_count(
        self,
        flag: str,
        metavar: str,
        minimum: int,
        default: int,
        what: str,
        maximum: int = 2**31 - 1,
    ) -> None:
        """Add the option ``flag``: an integer in ``[minimum, maximum]`` (``what``: its help)."""

        def parse(text: str) -> int:
            try:
                n = int(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected an integer, got {text!r:.40}") from None
            bounds = f"must be from {minimum} to {maximum:,}"
            if not minimum <= n <= maximum:
                raise argparse.ArgumentTypeError(f"{bounds}, got {text:.40}")
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
    demo.add_count("--seed", "S", 0, 0, "random seed", maximum=2**32 - 1)
    demo.add_count("--sample", "N", 0, 200, "characters to generate after training")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.set_defaults(run=functools.partial(_demo, demo))  # its errors name the command
    inspect = sub.add_parser(
        "inspect",
        help="print the sharing graph of a checkpoint, or the ties another tool's shows",
        description="Print the sharing graph (buffers, views, unique vs expanded counts and "
        "bytes) of a checkpoint written by sharetree.save; for a safetensors file or "
        "save_pretrained directory another tool wrote, its tensors and the ties it shows, "
        "with the ties= to pass to sharetree.load. Runs no code from the file.",
    )
    inspect.add_argument(
        "file", metavar="FILE_OR_DIR", help="the checkpoint (.safetensors, or a directory)"
    )
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
    from sharetree import _demo  # needs flax, optax and tqdm (checked above)

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
    path = args.file
    if not os.path.exists(path):
        parser.error(f"no such file: {path!r}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            text = describe(path, max_rows=args.max_rows)
        except (TieError, OSError) as e:  # one line, its notes (what was being read) included
            notes = " ".join(getattr(e, "__notes__", ()))
            parser.error(f"cannot read {path!r}: {e} {notes}")
    for w in caught:
        print(f"note: {' '.join(str(w.message).split())}", file=sys.stderr)
    print(text)


@bounded
def describe(path: PathOrStr, max_rows: int = 20) -> str:
    """What ``python -m sharetree inspect FILE`` prints, read without running code from the file.

    Raises:
        TieError: any problem (a missing or unreadable file, malformed
            metadata, a bad graph), as one line naming the file.

    Example:
        >>> import os, tempfile, numpy as np, sharetree as st
        >>> from sharetree.__main__ import describe
        >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
        >>> st.save(path, {"emb": np.zeros((4, 2), np.float32), "head": st.Tied("emb", st.T)})
        >>> print(describe(path).splitlines()[1])
        sharing graph: 1 buffer, 1 view
    """
    check_max_rows(max_rows, "inspect")
    path = file_path(path, "inspect")
    if os.path.isdir(path):
        return _describe_foreign(path, checkpoint_readers(path), max_rows)
    try:
        size = os.path.getsize(path)
    except OSError as e:
        what, fix = f"cannot read {path!r}", "give the path of a readable .safetensors file"
        raise error("E37", "inspect:", what, found=one_line(e), fix=fix) from e
    reader = Reader(path, "inspect")  # a pipe or a device: a TieError
    meta = reader.metadata
    if KEY_VERSION not in meta:
        return _describe_foreign(path, [reader], max_rows, size)
    contents = read_contents(reader, describe=True)  # fn and unknown transforms: stand-ins
    try:
        leaves, structure = leaves_and_structure(contents.tree)
        graph = SharingGraph(structure, leaves)  # a stand-in's view: shape and dtype unknown
        text = summary(graph, max_rows=max_rows)  # the tables escape what moves a terminal
    except TieError as e:
        add_context(e, f"inspect: {path!r} holds this sharing graph")
        raise
    head = (
        f"{path}: {size:,} bytes, sharetree format {meta[KEY_VERSION]} "
        f"(written by sharetree {printable(meta.get(KEY_LIBRARY, '?'))})"
    )
    notes = []
    named = sum(is_described(v.transform) for v in graph.views.values())
    if named:
        notes.append(
            f"note: {named:,} view(s) use st.fn functions the file names or transforms not "
            "registered in this process (shown by their spec); they were not imported or "
            "called, so their shape and dtype are not shown"
        )
    if contents.keys:
        notes.append(f"note: {len(contents.keys):,} buffer(s) hold PRNG key data (uint32)")
    return "\n".join([head, text, *_inputs_table(graph, max_rows), *notes])


def _describe_foreign(
    path: str, readers: list[Reader], max_rows: int, size: int | None = None
) -> str:
    """A checkpoint another tool wrote: its tensors, and the ties it shows with their ``ties=``."""
    infos = [info for r in readers for info in r.infos.values()]
    data = sum(info.nbytes for info in infos)
    where = f"{size:,} bytes" if size is not None else f"a directory of {len(readers)} file(s)"
    head = (
        f"{path}: {where}; a checkpoint not written by sharetree (no {KEY_VERSION!r} "
        f"metadata): {len(infos):,} tensors, {format_bytes(data)} of tensor data"
    )
    rows = [f"  {printable(i.name)}  {i.code}{list(i.shape)}" for i in infos[:max_rows]]
    more = more_line(len(infos), max_rows, "tensors")
    lines = [head, *rows, *(["  " + more] if more else [])]
    seen = suggest_ties(readers, path)
    if not seen:
        return "\n".join([*lines, "ties it shows: none"])
    lines.append(f"ties it shows ({len(seen)}):")
    for t in seen[:max_rows]:
        shown = "" if t.transform == identity else f" ({printable(repr(t.transform))})"
        lines.append(f"  {printable(t.target)} <- {printable(t.ref)}{shown}: {t.why}")
    more = more_line(len(seen), max_rows, "ties")
    lines += ["  " + more] if more else []
    asked = [t for t in seen if not t.recorded]
    if asked:
        code = ", ".join(printable(t.code()) for t in asked)
        lines.append(f"load it tied: st.load({printable(repr(path))}, ties={{{code}}})")
    else:
        lines.append("st.load restores these ties unasked (its metadata records them)")
    return "\n".join(lines)


def _inputs_table(graph: SharingGraph, max_rows: int) -> list[str]:
    """The lines naming each input of the views of several positions (none: no lines)."""
    several = [v for v in graph.views.values() if v.inputs]
    rows = [
        (
            key_str(v.path),
            repr(v.transform),
            ", ".join(
                f"{name} <- {key_str(x.source)}"
                + ("" if x.transform == identity else f" >> {x.transform!r}")
                for name, x in v.inputs.items()
            ),
        )
        for v in several[:max_rows]
    ]
    if not rows:
        return []
    more = more_line(len(several), max_rows, "views of several positions")
    return ["inputs:", *text_table(("view", "transform", "inputs"), rows, more)]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on ``argv`` (``sys.argv[1:]`` by default); return the exit code."""
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
