"""Loading safetensors files that sharetree did not write (PyTorch / Hugging Face checkpoints)."""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sharetree._compare import Copies, check_atol, check_copies, kind, kinds_differ
from sharetree._errors import TieError, add_context, check_mapping, error, short
from sharetree._files.container import CODES, Reader
from sharetree._files.format import KEY_VERSION
from sharetree._files.hf import checkpoint_readers
from sharetree._files.mlx_config import MlxConfig, read_config
from sharetree._files.mlx_load import mlx_tree
from sharetree._files.reads import Pending, Tensor, check_load_fits, read_tree
from sharetree._materialize import abstract_expanded, leaf_view, leaves_and_structure
from sharetree._paths import closest, format_aval
from sharetree._tie import tie
from sharetree._tied import Tied
from sharetree._transforms import (
    Transform,
    chain,
    identity,
    transpose,
    view_axis_names,
)

__all__ = ["metadata_ties", "load_foreign"]


_TIES = "pass ties={'lm_head.weight': 'model.embed_tokens.weight'} (transformers 5: ties="
_TIES += "model.all_tied_weights_keys; 4.x: the names of parameters that share storage)"

_UNTIED = "for ties the file omits or stores once, st.load(path, ties={'lm_head.weight': 'model."
_UNTIED += "embed_tokens.weight'}) (transformers 5: ties=model.all_tied_weights_keys); for ties "
_UNTIED += "stored twice, st.find_ties(tree)"


def _name(x: Any, what: str) -> str:
    """A tensor name from a tie's target or ref (a string, or a path of one key)."""
    name = x[0] if isinstance(x, tuple) and len(x) == 1 else x
    if isinstance(name, str) and name:
        return name
    raise error("E43", f"load: the tie {what} {short(x)}", "is not a tensor name", fix=_TIES)


def _parse_ties(ties: Any) -> dict[str, Tied]:
    """The requested ties of a flat state dict: ``{target: Tied((ref,), transform)}``."""
    check_mapping(ties, "E43", "load: ties=", "a mapping {target: ref} of tensor names", _TIES)
    out: dict[str, Tied] = {}
    for target, ref in ties.items():
        t = _name(target, "target")
        if isinstance(ref, Tied) and ref.inputs is not None:
            raise _several_error(t, ref)
        if isinstance(ref, Tied):
            # Tied("a/b") splits at '/'; a flat state dict has the one key 'a/b'
            tied = Tied(("/".join(map(str, ref.ref)),), ref.transform, up=ref.up)
        else:
            tied = Tied((_name(ref, "ref"),))
        if t in out:
            raise error("E43", f"load: the tie target {t!r} is given twice", fix="keep one entry")
        out[t] = tied
    return out


def _several_error(target: str, t: Tied) -> TieError:
    """E169: ``ties=`` holds a view of several positions (a file's tensors tie one to one)."""
    where = f"load: ties= {{{target!r}: {t!r}}}"
    problem = "is a view of several positions; ties= of a file other tools wrote are one to one"
    expected = "a tensor name or st.Tied(name, transform)"
    fix = (
        f"load without it, then add the view to the flat dict: tree[{target!r}] = {t!r} "
        "(or st.tie(tree, {...}) to replace a tensor the file holds, its shape checked)"
    )
    return error("E169", where, problem, expected=expected, fix=fix)


def _apply_ties(
    label: str,
    tensors: dict[str, Tensor],
    file_ties: dict[str, str],
    asked: dict[str, Tied],
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The canonical flat dict (its buffers not read yet), and the targets to compare by value."""
    # the file's own ties: one tensor for both names
    tree: dict[str, Any] = {**tensors, **{d: tensors[k] for d, k in file_ties.items()}}
    moved: set[str] = set()
    for target, t in asked.items():  # first the moves, so that any tie may refer to a moved buffer
        (ref,) = t.ref
        if target in tree and ref not in tree and ref not in asked:
            back = t.transform.inverse()  # the file stores only the target: move its buffer
            if back is None:
                only = f"the file holds {target!r} but not {ref!r}; {t.transform!r} has no inverse"
                fix = f"load without this tie, or a checkpoint that holds {ref!r}"
                raise error("E45", f"load {label}: tie {target!r} <- {t!r}:", only, fix=fix)
            tree[ref], moved = _moved(tree[target], back), moved | {target}
    compare: dict[tuple[str, ...], Tied] = {}
    for target, t in asked.items():
        if target in tree:
            compare[(target,)] = t
        elif t.ref[0] in tree or t.ref[0] in asked:
            tree[target] = t  # absent on purpose: nothing to compare
        else:
            where = f"load {label}: tie {target!r} <- {t.ref[0]!r}:"
            neither = f"neither is in the file; {closest(t.ref[0], set(tree))}"
            raise error("E44", where, neither, fix="use the tensor names the file holds")
    copies = {  # a moved buffer is its target; the file's own tie is one tensor
        k: tree[k]
        for (k,), t in compare.items()
        if k not in moved and not (tree[k] is tree.get(t.ref[0]) and t.transform == identity)
    }
    for dropped, kept in file_ties.items():
        reversed_ = kept in asked and asked[kept].ref == (dropped,)
        given_other = dropped in asked and asked[dropped] != Tied((kept,))
        if given_other or (reversed_ and asked[kept].transform != identity):
            given = f"{dropped!r} <- {asked[dropped]!r}" if dropped in asked else ""
            given = given or f"{kept!r} <- {asked[kept]!r}"
            where = f"load {label}: ties= {given}"
            problem = f"contradicts the file's own tie {dropped!r} <- {kept!r} (its metadata: "
            problem += "one tensor stored for both names, equal by construction)"
            fix = f"drop {given.split(' <- ')[0]} from ties=, or tie it as the file does"
            raise error("E261", where, problem, fix=fix)
        if dropped not in asked and not reversed_:
            tree[dropped] = Tied((kept,))  # the file's own tie
    try:
        out = tie(tree, compare, check=False)
        views = abstract_expanded(out)  # every view computes (shapes of absent targets included)
    except TieError as e:
        add_context(e, f"while loading {label} with ties")
        raise
    for (k,), t in compare.items():  # each view must be what the file holds there
        held, view = jax.ShapeDtypeStruct(tree[k].shape, tree[k].dtype), views[(k,)]
        if kind(held) != kind(view):
            c = Copies(f"load {label}: tie {k!r} <- {t!r}", k, t.ref[0], t.transform, load=True)
            keep = f"load without this tie, keeping {k!r} as a buffer of its own"
            raise kinds_differ(c, format_aval(view), format_aval(held), keep)
    return dict(sorted(out.items())), copies


def _moved(x: Pending, back: Transform) -> Pending:
    """``back`` of ``x``: the buffer of a ref stored as its target (a permutation read lazily)."""
    if back is identity:
        return x
    n = len(x.shape)
    axes = view_axis_names(back, tuple(range(n)), jax.ShapeDtypeStruct(x.shape, x.dtype))
    # read lazily only if ``back`` is exactly that permutation (a flip also keeps its axes)
    if (
        isinstance(x, Tensor)
        and axes is not None
        and sorted(axes) == list(range(n))
        and chain(back, transpose(*np.argsort(axes).tolist())) == identity
    ):
        rel = tuple(int(a) for a in axes)  # axis k of the ref is axis rel[k] of x
        shape = tuple(x.shape[a] for a in rel)
        perm = rel if x.axes is None else tuple(x.axes[a] for a in rel)
        return Tensor(x.reader, x.name, shape, x.dtype, axes=perm)
    aval = back.abstract(jax.ShapeDtypeStruct(x.shape, x.dtype))
    return _Computed(x, back, tuple(aval.shape), aval.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class _Computed(Pending):
    """``transform`` of another pending leaf, computed on the host as it is read."""

    source: Pending
    transform: Transform
    shape: tuple[int, ...]
    dtype: Any

    def read(self) -> np.ndarray:
        return np.ascontiguousarray(self.transform.numpy(self.source.read()))

    def place(self, sharding: Any) -> jax.Array:
        host = self.read()  # not an axis permutation: whole on the host, then each shard
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _check_copies(
    label: str, tree: dict[str, Any], copies: dict[str, Tensor], asked: dict[str, Tied], atol: float
) -> None:
    """Each copy the file holds against the view that replaces it (placed: on its devices)."""
    leaves, structure = leaves_and_structure(tree)
    for k, leaf in enumerate(structure.expanded):
        (name,) = leaf.path
        if name not in copies:
            continue
        buffer, t = leaves[leaf.buffer], leaf.transform or identity
        (ref,) = structure.buffer_paths[leaf.buffer]
        c = Copies(f"load {label}: tie {name!r} <- {asked[name]!r}", name, ref, t, load=True)
        on_host = not isinstance(buffer, jax.Array)
        try:  # on the devices of the buffer (eager ops run where their inputs are)
            with jax.enable_x64(on_host):  # a float64 file compared in float64, as st.tie does
                view = leaf_view(structure, k, t, buffer)
        except TieError as e:  # e.g. a slice across a sharded Explicit mesh axis
            add_context(e, f"while loading {label} with ties")
            raise
        if on_host:  # as st.tie compares
            check_copies(c, copies[name].read(), view, atol)
        else:
            check_load_fits(name, view.shape, view.sharding)
            check_copies(c, copies[name].place(view.sharding), view, atol, on_devices=True)


def metadata_ties(metadata: Mapping[str, str], tensors: Mapping[str, Any]) -> dict[str, str]:
    """The ``{removed: kept}`` ties safetensors metadata records, as ``save_model`` writes them.

    ``tensors``: the file's tensors by name (each with a ``shape`` and a ``dtype`` or a
    dtype ``code``). An entry is read as a tie when both of its names are tensor names (a
    tensor of the file, or a dotted name sharing its first or last part with one,
    ``lm_head.weight``); other entries are plain metadata (``format``, ``notes``, never a
    tie). A chain of entries is followed in time linear in the entries. A recorded tie that
    cannot be honoured is E260: the kept tensor missing, the removed name stored too, or
    entries that lead round in a cycle.

    Example:
        >>> import numpy as np
        >>> held = {"embed.weight": np.zeros((4, 2))}
        >>> metadata_ties({"format": "pt", "head.weight": "embed.weight"}, held)
        {'head.weight': 'embed.weight'}
    """
    # in sorted order: a file's metadata has no order of its own (safetensors hashes it)
    like = _TensorNames(tensors)
    entries = {k: v for k, v in sorted(metadata.items()) if k != "format" and like.tie(k, v)}
    fix = "save the model again (safetensors.torch.save_model writes these entries)"
    out: dict[str, str] = {}
    for removed, kept in entries.items():
        where = f"load: the tie {removed!r} <- {kept!r} the file's safetensors metadata records"
        if removed in tensors:
            found = f"{removed!r} {_aval_of(tensors[removed])} stored too"
            if kept in tensors:
                found += f", beside {kept!r} {_aval_of(tensors[kept])}"
            problem = "names as removed (stored once, under the kept name) a tensor the file holds"
            raise error("E260", where, problem, found=found, fix=fix)
        # a chain of removed names ends at the stored one: each name walked once, its end kept
        path, on_path, x = [removed], {removed}, kept
        while x not in tensors and x not in out and x in entries:
            if x in on_path:
                cycle = " <- ".join(map(repr, [*path[path.index(x) :], x]))
                problem = "forms a cycle: no name of it is stored"
                raise error("E260", where, problem, found=cycle, fix=fix)
            path.append(x)
            on_path.add(x)
            x = entries[x]
        end = x if x in tensors else out.get(x)
        if end is None:
            found = f"no tensor {x!r}; {closest(x, set(tensors))}"
            raise error("E260", where, "keeps a tensor the file lacks", found=found, fix=fix)
        out.update(dict.fromkeys(path, end))
    return {removed: out[removed] for removed in entries}


_NAME = re.compile(r"[\w\-]+(\.[\w\-]+)+")


class _TensorNames:
    """What a file's tensor names look like: their first and last parts, found once."""

    def __init__(self, tensors: Mapping[str, Any]) -> None:
        self.tensors = tensors
        self.firsts = {n.split(".", 1)[0] for n in tensors}
        self.lasts = {n.rsplit(".", 1)[-1] for n in tensors if "." in n}
        self.flat = any("." not in n for n in tensors)  # names like 'emb', not 'a.weight'

    def named(self, x: str) -> bool:
        """Whether ``x`` is a tensor of the file or named like one.

        Named like one: a dotted name sharing its first or last part with a tensor's, or,
        in a file with undotted tensor names (``emb``), an identifier.
        """
        if x in self.tensors:
            return True
        if self.flat and x.isidentifier():
            return True
        return _NAME.fullmatch(x) is not None and (
            x.split(".", 1)[0] in self.firsts or x.rsplit(".", 1)[-1] in self.lasts
        )

    def tie(self, key: str, value: Any) -> bool:
        """Whether a metadata entry is meant as a tie: both of its names are tensor names.

        ``{"notes": "w.weight"}`` is not (``notes`` is named like no tensor of a file of
        dotted names); ``{"lm_head.weight":
        "model.embed_tokens.weight"}`` is, the head stored once under the embedding's name.
        """
        return isinstance(value, str) and self.named(key) and self.named(value)


def _aval_of(tensor: Any) -> str:
    """``float32[4, 2]`` of a file's tensor (a ``Tensor``, or a header's ``TensorInfo``)."""
    dtype = getattr(tensor, "dtype", None)
    name = np.dtype(dtype).name if dtype is not None else str(getattr(tensor, "code", "?"))
    return f"{name}[{', '.join(map(str, tensor.shape))}]"


def _tensor(reader: Reader, name: str) -> Tensor:
    """The tensor ``name`` of ``reader``, not read yet (a dtype code it does not know: an error)."""
    info = reader.infos[name]
    if info.code not in CODES:
        reader.read(name)  # raises, naming the code
    return Tensor(reader, name, info.shape, np.dtype(jnp.dtype(CODES[info.code])))


def load_foreign(
    path: str,
    like: Any = None,
    ties: Any = None,
    atol: float | None = None,
    shardings: Any = None,
    reader: Reader | None = None,
) -> dict[str, Any]:
    """Load a safetensors file or ``save_pretrained`` directory that sharetree did not write.

    Returns the canonical flat dict ``{tensor name: array or Tied}`` sorted by
    name, with a warning. ``ties`` (refs may be ``st.Tied(name, transform)``),
    ``atol`` and ``shardings`` are as for :func:`sharetree.load`; ``like``
    must be ``None``; ``reader``: the file's, if open. See "Importing Hugging
    Face checkpoints" in ``docs/saving_and_scaling.md``.
    """
    readers = checkpoint_readers(path, reader)  # headers only: every tensor is read once, below
    label = repr(path)
    foreign = f"was not written by sharetree (no {KEY_VERSION!r} in its metadata)"
    if like is not None:
        fix = "load it without like= (a flat dict {tensor name: array}; ties= for its ties)"
        raise error("E141", f"load(like=): {label}", foreign, fix=fix)
    if atol is not None and ties is None:
        fix = "pass ties={'lm_head.weight': 'model.embed_tokens.weight'} too, or drop atol"
        raise error("E60", f"load: atol={short(atol, 40)} without ties= for {label}", fix=fix)
    mlx = read_config(path) if os.path.isdir(path) else None
    if mlx is not None:
        return _load_mlx(label, foreign, readers, mlx, ties, atol, shardings)
    atol = 0.0 if atol is None else check_atol(atol, "load")
    asked = {} if ties is None else _parse_ties(ties)
    tensors = {name: _tensor(r, name) for r in readers for name in r.infos}
    file_ties = {k: v for r in readers for k, v in metadata_ties(r.metadata, tensors).items()}
    tree, copies = _apply_ties(label, tensors, file_ties, asked)
    tree = read_tree(label, tree, shardings)  # every check first: shapes, ties, shardings
    _check_copies(label, tree, copies, asked, atol)
    n = f"{len(readers)} files" if len(readers) > 1 else "one file"
    said = f"loaded as a flat dict of {len(tensors)} arrays {{tensor name: array}} from {n}"
    if file_ties:
        shown = ", ".join(f"{k!r} <- {v!r}" for k, v in file_ties.items())
        said += f"; restored the ties its safetensors metadata records: {shown}"
    if asked:
        shown = ", ".join(
            f"{k!r} <- {t.ref[0]!r}" + ("" if t.transform == identity else f" ({t.transform!r})")
            for k, t in asked.items()
        )
        said += f"; tied as asked (ties=): {shown}"
    note = error("E142", f"load: {label}", f"{foreign}: {said}", fix="" if asked else _UNTIED)
    warnings.warn(str(note), stacklevel=3)
    return tree


def _load_mlx(
    label: str,
    foreign: str,
    readers: list[Reader],
    config: MlxConfig,
    ties: Any,
    atol: float | None,
    shardings: Any,
) -> dict[str, Any]:
    """An MLX directory whose ``config.json`` quantizes it: its packed layers and their views."""
    if atol is not None:
        where = f"load: atol={short(atol, 40)} for {label}"
        problem = "compares a tie's copies, and an MLX directory stores a tied head once"
        raise error("E214", where, problem, fix="drop atol")
    asked = None if ties is None else _parse_ties(ties)
    tensors = {name: _tensor(r, name) for r in readers for name in r.infos}
    file_ties = {k: v for r in readers for k, v in metadata_ties(r.metadata, tensors).items()}
    made = mlx_tree(label, tensors, config, asked, file_ties)
    tree = read_tree(label, made.tree, shardings)
    n = f"{len(readers)} files" if len(readers) > 1 else "one file"
    sizes = sorted({(q.bits, q.group_size) for q in made.layers.values()})
    said = f"loaded as a flat dict from {n} with {config.path!r}: {len(made.layers)} quantized "
    said += "layers, each {'q', 'scales', 'biases'} under its name and its float '<name>.weight' "
    said += f"a dequantize view (bits, group_size: {', '.join(map(str, sizes)) or 'none'})"
    if made.ties:
        shown = ", ".join(f"{k!r} <- {v!r}" for k, v in made.ties.items())
        said += f"; tied {shown}" + (" (tie_word_embeddings)" if ties is None else " (ties=)")
    warnings.warn(str(error("E142", f"load: {label}", f"{foreign}: {said}")), stacklevel=5)
    return tree
