"""``load``: a file's canonical tree, every ``Tied`` back; ``read_contents`` for ``inspect``.

A load goes down the layers once: the safetensors header is read once
(``container.Reader``); a file sharetree did not write (or a directory) is handed
whole to ``foreign``; otherwise ``header`` checks the ``sharetree.*`` metadata and
makes the tree (ties resolved, buffers not read), this module fits it to ``like``,
``_materialize`` checks the sharing graph, and only then ``reads.read_tree``
reads each tensor, once. The format: "The file format" in ``docs/saving_and_scaling.md``.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Mapping
from typing import Any

import jax.tree_util as jtu

from sharetree._errors import FIXES, TieError, add_context, bounded, check_mapping, error
from sharetree._files.container import Reader
from sharetree._files.disk import PathOrStr, file_path
from sharetree._files.foreign import load_foreign
from sharetree._files.format import KEY_VERSION, PREFIX
from sharetree._files.header import Header, Unsaved, read_header
from sharetree._files.reads import Pending, only_in, read_tree
from sharetree._materialize import abstract_expanded
from sharetree._paths import TieMap, leaves_with_paths, path_str
from sharetree._tied import Tied, is_tied
from sharetree._transforms import describe_transform, transform_from_spec

__all__ = ["read_metadata", "read_contents", "load"]


def read_metadata(path: PathOrStr) -> dict[str, str]:
    """The metadata entries of a safetensors file other than sharetree's own (``sharetree.*``)."""
    meta = Reader(file_path(path, "read_metadata"), "read_metadata").metadata
    return {k: v for k, v in meta.items() if not k.startswith(PREFIX)}


def read_contents(reader: Reader, functions: Any = None, *, describe: bool = False) -> Header:
    """The tree of a file ``st.save`` wrote, its metadata checked (``_header``); no tensor read.

    Buffers are :class:`~sharetree._files.reads.BufferLeaf` leaves, read when asked. With
    ``describe`` (what ``python -m sharetree inspect`` shows): ``jax.ShapeDtypeStruct``
    leaves of their data, and each transform a stand-in that names an ``fn``'s function or
    an unknown class without calling it. Every problem is a TieError naming the file and
    the path.
    """
    if describe:
        return read_header(reader, describe_transform, lazy=False)
    return read_header(reader, functools.partial(transform_from_spec, functions=functions))


@bounded
def load(
    path: PathOrStr,
    like: Any = None,
    *,
    ties: TieMap | None = None,
    atol: float | None = None,
    functions: Mapping[str, Any] | None = None,
    shardings: Any = None,
) -> Any:
    r"""Read a file written by :func:`save`: the canonical tree, every ``Tied`` back.

    Buffers come back as NumPy arrays, or on devices with ``shardings``. A file
    or directory that sharetree did not write (a PyTorch or Hugging Face
    checkpoint) loads as a flat dict ``{tensor name: array}`` with a warning;
    a directory in MLX's quantized layout (``config.json`` with
    ``quantization``) has each packed layer ``{"q", "scales", "biases"}`` under
    its name, its ``<name>.weight`` a ``dequantize`` view, and the tied head
    the same view of the embedding (write it back with :func:`save_mlx`).
    Nothing the file names is imported or called. Details:
    ``docs/saving_and_scaling.md``.

    Args:
        path: the file.
        like: a template with the file's paths, buffer shapes, dtypes and ties
            (leaves may be ``jax.ShapeDtypeStruct``) for pytree nodes other
            than dicts, lists, tuples and ``None``, static fields and leaves
            no file holds; without one, such nodes load as dicts (a warning).
        ties: ``{target: ref}`` for a file not written by sharetree.
        atol: with ``ties``, how far a present target may differ from its ref
            (default: not at all; ``-0.0`` equals ``0.0``, NaN equals NaN).
        functions: ``{"module:qualname": function}`` for ``st.fn`` transforms.
        shardings: a tree of ``jax.sharding.Sharding`` with the canonical
            structure (``Tied`` positions ignored, ``None``: on the host).

    Raises:
        FileNotFoundError: the file does not exist (other ``OSError``\ s pass
            through too).
        TieError: a bad argument or file (naming the file and the path), a
            template or ``shardings`` that does not match.

    Example:
        >>> import os, tempfile, numpy as np, sharetree as st
        >>> tree = {"enc": {"w": np.ones((2, 3))}, "dec": {"w": st.Tied("enc/w", st.T)}}
        >>> path = os.path.join(tempfile.mkdtemp(), "ae.safetensors")
        >>> st.save(path, tree)
        >>> back = st.load(path)
        >>> back["dec"]["w"], back["enc"]["w"].shape
        (Tied('enc/w', T), (2, 3))
    """
    path = file_path(path, "load")
    if functions is not None:
        want = "a mapping {'module:qualname': function}"
        check_mapping(functions, "E55", "load: functions=", want, FIXES["functions"])
    if not os.path.exists(path):
        raise FileNotFoundError(f"load: no such file: {path!r}")
    reader = None if os.path.isdir(path) else Reader(path)
    if reader is None or KEY_VERSION not in reader.metadata:
        return load_foreign(path, like, ties, atol, shardings, reader)
    if ties is not None or atol is not None:
        fix = "drop ties= and atol=, or tie the loaded tree with st.tie"
        raise error("E36", f"load: {path!r}", "was written by st.save with its ties", fix=fix)
    contents = read_contents(reader, functions)
    tree = contents.tree  # buffers not read yet: every check first, then one pass over the file
    if like is not None:
        tree = _restore_like(path, tree, like)
    elif contents.statics:
        (where, kind), n = contents.statics[0], len(contents.statics)
        what = f"has {n} leaves a file cannot hold, such as {kind} at {path_str(where)!r}"
        fix = "pass a template that supplies them: st.load(path, like=model)"
        raise error("E129", f"load: {path!r}", what, fix=fix)
    elif contents.generic:
        (where, kind), n = contents.generic[0], len(contents.generic)
        what = f"loaded {n} pytree node(s) as dicts, such as {kind} at {path_str(where)!r}"
        fix = "pass like=template for the original types" + (
            " (Flax boxes: like=jax.eval_shape(lambda: model.init(key, x))['params'])"
            if any("Partitioned" in k for _, k in contents.generic)
            else ""
        )
        warnings.warn(str(error("E130", f"load: {path!r}", what, fix=fix)), stacklevel=3)
    try:  # dangling refs, cycles, bad transforms; only the caller's functions are ever called
        abstract_expanded(tree)
    except TieError as e:
        add_context(e, f"load: {path!r} holds this sharing graph")
        raise
    return read_tree(repr(path), tree, shardings)


def _describe_leaf(x: Any) -> str:
    if isinstance(x, Tied):
        return repr(x)
    if isinstance(x, Unsaved):
        return f"an unsaved {x.kind} leaf"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"a buffer {x.dtype}{list(x.shape)}"
    return f"{type(x).__name__} {x!r}"


def _restore_like(path: str, tree: Any, like: Any) -> Any:
    """``tree`` in the types of the template ``like`` (its static leaves too), checked."""
    got, tmpl = dict(leaves_with_paths(tree, is_tied)), leaves_with_paths(like, is_tied)
    fix = "pass a template of the same model and configuration"
    if got.keys() != dict(tmpl).keys():
        file, template = only_in(got, dict(tmpl)), only_in(dict(tmpl), got)
        only = f"paths only in the file: {file}; only in the template: {template}"
        raise error("E128", f"load: {path!r}: like=", "does not match", found=only, fix=fix)
    leaves: list[Any] = []
    for p, t in tmpl:
        f, where = got[p], path_str(p)
        if isinstance(t, Tied) or isinstance(f, Tied):
            if isinstance(t, Tied) and isinstance(f, Tied) and t == f:
                continue
            fix = (
                f"tie the template the same way: st.tie(template, {{{where!r}: {f!r}}})"
                if isinstance(f, Tied) and not isinstance(t, Tied)
                else "tie the template as the saved tree was tied"
            )
        elif isinstance(f, Unsaved) or (
            isinstance(f, Pending) and tuple(f.shape) == tuple(t.shape) and f.dtype == t.dtype
            if hasattr(t, "shape") and hasattr(t, "dtype")
            else type(f) is type(t)
        ):
            leaves.append(t if isinstance(f, Unsaved) else f)
            continue
        found = f"{_describe_leaf(f)} in the file, {_describe_leaf(t)} in the template"
        raise error("E128", f"load: {path!r}: like= at {where!r}", found=found, fix=fix)
    return jtu.tree_unflatten(jtu.tree_structure(like), leaves)
