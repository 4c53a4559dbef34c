"""Loading safetensors files that sharetree did not write (PyTorch / Hugging Face checkpoints)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import warnings
from collections.abc import Container, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sharetree._errors import TieError
from sharetree._format import KEY_VERSION
from sharetree._materialize import _view, abstract_expanded, leaves_and_structure
from sharetree._paths import closest, format_aval
from sharetree._safetensors import (
    _CODES,
    DuplicateKey,
    Pending,
    Reader,
    Tensor,
    check_load_fits,
    read_tree,
    unique_pairs,
)
from sharetree._tie import _abs_diff, _kind, bit_equal, tie
from sharetree._tied import Tied
from sharetree._transforms import (
    Transform,
    chain,
    identity,
    transpose,
    view_axis_names,
)

__all__ = ["load_foreign", "metadata_ties", "SINGLE_FILE", "INDEX_FILE"]

SINGLE_FILE = "model.safetensors"
"""The weights file of a ``save_pretrained`` directory."""

INDEX_FILE = "model.safetensors.index.json"
"""The index of a sharded ``save_pretrained`` directory (``weight_map``: tensor -> shard)."""

_MAX_INDEX_BYTES = 64 << 20  # an index names tensors and files; anything larger is not one


def _name(x: Any, what: str) -> str:
    """A tensor name from a tie's target or ref (a string, or a path of one key)."""
    name = x[0] if isinstance(x, tuple) and len(x) == 1 else x
    if isinstance(name, str) and name:
        return name
    raise TieError(
        f"load: the tie {what} {x!r} is not a tensor name. A file not written by sharetree "
        "is a flat state dict, so each path is one tensor name, e.g. 'lm_head.weight'. "
        "Fix: pass ties={'lm_head.weight': 'model.embed_tokens.weight'} "
        "(transformers 5: ties=model.all_tied_weights_keys)."
    )


def _parse_ties(ties: Any) -> dict[str, Tied]:
    """The requested ties of a flat state dict: ``{target: Tied((ref,), transform)}``."""
    if not isinstance(ties, Mapping):
        raise TieError(
            f"load: ties must be a mapping {{target: ref}}, got {type(ties).__name__} "
            f"{ties!r:.200}. Fix: pass ties={{'lm_head.weight': 'model.embed_tokens.weight'}} "
            "(transformers 5: ties=model.all_tied_weights_keys; 4.x: the names of "
            "model.named_parameters(remove_duplicate=False) that share storage)."
        )
    out: dict[str, Tied] = {}
    for target, ref in ties.items():
        t = _name(target, "target")
        if isinstance(ref, Tied):
            # Tied("a/b") splits at '/'; a flat state dict has the one key 'a/b'
            tied = Tied(("/".join(map(str, ref.ref)),), ref.transform)
        else:
            tied = Tied((_name(ref, "ref"),))
        if t in out:
            raise TieError(f"load: the tie target {t!r} is given twice. Fix: keep one entry.")
        out[t] = tied
    return out


# ----------------------------------------------------------------------------- files


def _readers(path: str, reader: Reader | None = None) -> list[Reader]:
    """The safetensors files of ``path`` (a file, or a ``save_pretrained`` directory), headers read.

    ``reader``: the file's, if open. A directory's file written by ``st.save`` is refused.
    """
    if not os.path.isdir(path):
        return [Reader(path) if reader is None else reader]
    single, index = os.path.join(path, SINGLE_FILE), os.path.join(path, INDEX_FILE)
    if os.path.isfile(single) and os.path.isfile(index):
        raise TieError(
            f"load: the directory {path!r} holds both {SINGLE_FILE!r} and {INDEX_FILE!r}, so "
            "it is not clear which checkpoint is meant. Fix: remove the stale one, or load "
            "the file itself."
        )
    readers = [Reader(single)] if os.path.isfile(single) else _shards(path, index)
    for r in readers:  # as a state dict, a file st.save wrote would lose its tree and ties
        if KEY_VERSION in r.metadata:
            raise TieError(
                f"load: the directory {path!r} holds {os.path.basename(r.path)!r}, a file "
                "written by st.save; read as a save_pretrained checkpoint (a flat state dict) "
                f"it would lose its tree and ties. Fix: load the file itself: "
                f"st.load({r.path!r})."
            )
    return readers


def _shards(path: str, index: str) -> list[Reader]:
    """The shards of the directory ``path``, checked against its ``index`` (tensor -> shard)."""
    if not os.path.isfile(index):
        raise TieError(
            f"load: {path!r} is a directory that holds neither {SINGLE_FILE!r} nor {INDEX_FILE!r} "
            "(a Hugging Face save_pretrained directory in safetensors format). If it is an Orbax "
            "checkpoint, restore it with orbax.checkpoint and an abstract canonical tree as "
            "target (see docs/saving_and_scaling.md); a pickled pytorch_model.bin is never "
            "loaded (convert it to safetensors first)."
        )
    if os.path.getsize(index) > _MAX_INDEX_BYTES:
        raise TieError(
            f"load: {index!r} is larger than {_MAX_INDEX_BYTES >> 20} MiB; a shard index only "
            "names tensors and files. Fix: check that the path names the right file."
        )
    with open(index, "rb") as f:
        raw = f.read()
    try:
        data = json.loads(raw, object_pairs_hook=unique_pairs)
    except DuplicateKey as e:
        raise TieError(
            f"load: {index!r} lists {e.key!r} twice ({e.first!r} and {e.second!r}), so one entry "
            "would be lost. Fix: write the index again (save_pretrained)."
        ) from None
    except (ValueError, RecursionError) as e:
        raise TieError(
            f"load: {index!r} is not valid JSON ({type(e).__name__}: {str(e)[:200]}). "
            "Fix: write the index again (save_pretrained)."
        ) from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise TieError(
            f"load: {index!r} has no 'weight_map' object of tensor name -> shard file name. "
            "Fix: write the index again (save_pretrained)."
        )
    for name, shard in weight_map.items():
        if shard in ("", ".", "..") or os.path.basename(shard) != shard or "/" in shard:
            raise TieError(
                f"load: {index!r} puts {name!r} in {shard!r}, which is not a file name in the "
                "index's directory (shards never lie elsewhere). Fix: write the index again."
            )
    for name, shard in weight_map.items():
        if not os.path.isfile(os.path.join(path, shard)):
            raise TieError(
                f"load: {index!r} names the shard {shard!r} (holding {name!r}, ...), which "
                f"does not exist in {path!r}. Fix: copy the missing shard, or save the "
                "checkpoint again."
            )
    readers = [Reader(os.path.join(path, s)) for s in dict.fromkeys(weight_map.values())]
    where: dict[str, str] = {}
    for reader in readers:
        shard = os.path.basename(reader.path)
        for name in reader.infos:
            if name in where:
                raise TieError(
                    f"load: the tensor {name!r} is stored in both {where[name]!r} and "
                    f"{shard!r} (shards of {index!r}); the two copies would be a silent pick. "
                    "Fix: save the checkpoint again."
                )
            where[name] = shard
    for name in {**where, **weight_map}:  # first the tensors of the shards, then the rest
        if name not in where:
            raise TieError(
                f"load: {index!r} puts {name!r} in {weight_map[name]!r}, but that shard does "
                "not hold it (it is in no shard). Fix: save the checkpoint again."
            )
        if (listed := weight_map.get(name)) != where[name]:
            said = "does not list it" if listed is None else f"puts it in {listed!r}"
            raise TieError(
                f"load: the shard {where[name]!r} holds {name!r}, but {index!r} {said}. "
                "Fix: write the index again (save_pretrained), or remove the stray shard."
            )
    return readers


# ----------------------------------------------------------------------------- ties


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
                raise TieError(
                    f"load {label}: the tie {target!r} <- {ref!r} ({t.transform!r}): the "
                    f"file holds {target!r} but not {ref!r}, and {t.transform!r} has no "
                    f"inverse, so {ref!r} cannot be computed from it. Fix: "
                    f"load without this tie, keeping {target!r} as a buffer of its own, or "
                    f"load a checkpoint that holds {ref!r}."
                )
            tree[ref], moved = _moved(tree[target], back), moved | {target}
    compare: dict[tuple[str, ...], Tied] = {}
    for target, t in asked.items():
        if target in tree:
            compare[(target,)] = t
        elif t.ref[0] in tree or t.ref[0] in asked:
            tree[target] = t  # absent on purpose: nothing to compare
        else:
            raise TieError(
                f"load {label}: the tie {target!r} <- {t.ref[0]!r}: neither is in the file; "
                f"{closest(t.ref[0], set(tree))}. Fix: use the tensor names the file holds, as "
                "model.state_dict() names them."
            )
    copies = {  # a moved buffer is its target; the file's own tie is one tensor
        k: tree[k]
        for (k,), t in compare.items()
        if k not in moved and not (tree[k] is tree.get(t.ref[0]) and t.transform == identity)
    }
    for dropped, kept in file_ties.items():
        reversed_ = kept in asked and asked[kept].ref == (dropped,)
        if dropped not in asked and not reversed_:
            tree[dropped] = Tied((kept,))  # the file's own tie, unless ties= says otherwise
    try:
        out = tie(tree, compare, check=False)
        views = abstract_expanded(out)  # every view computes (shapes of absent targets included)
    except TieError as e:
        raise TieError(f"load {label} with ties: {e}") from None
    for (k,), t in compare.items():  # each view must be what the file holds there
        held, view = jax.ShapeDtypeStruct(tree[k].shape, tree[k].dtype), views[(k,)]
        if _kind(held) != _kind(view):
            raise TieError(
                f"load {label} with ties: tie {k!r} <- {t!r}: the file holds {k!r} as "
                f"{format_aval(held)}, but the view is {format_aval(view)}. Fix: tie through a "
                f"transform that gives {format_aval(held)} (st.T, st.astype, st.slice, ...), or "
                f"load without this tie, keeping {k!r} as a buffer of its own."
            )
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


def _compare(
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
        on_host = not isinstance(buffer, jax.Array)
        try:  # on the devices of the buffer (eager ops run where their inputs are)
            with jax.enable_x64(on_host):  # a float64 file compared in float64, as st.tie does
                view = _view(structure, k, t, buffer)
        except TieError as e:  # e.g. a slice across a sharded Explicit mesh axis
            raise TieError(f"load {label} with ties: {e}") from e.__cause__
        worst: float
        bad: float
        if on_host:  # as st.tie compares
            held, computed = copies[name].read(), np.asarray(view)
            same = bit_equal(held, computed)
            d: np.ndarray = np.zeros(0) if same else _abs_diff(held, computed)
            worst = float(d.max()) if d.size else 0.0
            bad, size = int(np.count_nonzero(d > atol)), d.size
        else:
            check_load_fits(name, view.shape, view.sharding)
            copy = copies[name].place(view.sharding)
            with jax.enable_x64(True):  # float64 checkpoints compared in float64, as st.tie does
                worst, bad = (float(x.addressable_data(0)) for x in _differ(copy, view, atol))
            size = copy.size
        if worst > atol:
            seen = repr(ref) if t == identity else f"{t!r} of {ref!r}"
            other = (
                f"to keep {name!r} instead, tie the other way round"
                if t.inverse() is not None
                else f"to keep {name!r} instead, write the values you want into {ref!r} ({t!r} "
                f"has no inverse to tie {ref!r} to {name!r}), or keep {ref!r}"
            )
            raise TieError(
                f"load {label} with ties: tie {name!r} <- {asked[name]!r}: the two copies "
                f"differ: {name!r} and {seen} differ by up to {worst:.6g} (max abs difference; "
                f"{int(bad)} of {size} elements above atol={atol}), so they are not one "
                f"tied weight. Fix: {other}; or raise atol to {worst:.3g} if the difference "
                "is rounding; or load without ties."
            )


@functools.partial(jax.jit, static_argnums=2)
def _differ(a: jax.Array, b: jax.Array, atol: float) -> tuple[jax.Array, jax.Array]:
    """The largest ``|a - b|`` (NaN equals NaN, as in ``st.tie``) and how many exceed ``atol``."""
    wide = jnp.complex128 if jnp.iscomplexobj(a) or jnp.iscomplexobj(b) else jnp.float64
    x, y = a.astype(wide), b.astype(wide)
    same = (x == y) | (jnp.isnan(x) & jnp.isnan(y))  # equal infinities and NaNs count as equal
    d = jnp.abs(x - y)
    d = jnp.where(same, 0.0, jnp.where(jnp.isnan(d), jnp.inf, d))
    return (d.max(initial=0.0), jnp.sum(d > atol))


def metadata_ties(metadata: Mapping[str, str], names: Container[str]) -> dict[str, str]:
    """The ``{dropped: kept}`` entries of safetensors metadata, as ``save_model`` writes them.

    ``format`` is the framework (``"pt"``), never a tensor name, even if a tensor is named so.
    """
    return {k: v for k, v in metadata.items() if k != "format" and k not in names and v in names}


def _tensor(reader: Reader, name: str) -> Tensor:
    """The tensor ``name`` of ``reader``, not read yet (a dtype code it does not know: an error)."""
    info = reader.infos[name]
    if info.code not in _CODES:
        reader.read(name)  # raises, naming the code
    return Tensor(reader, name, info.shape, np.dtype(jnp.dtype(_CODES[info.code])))


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
    readers = _readers(path, reader)  # headers only: every tensor is read once, below
    label = repr(path)
    if like is not None:
        raise TieError(
            f"load: {label} was not written by sharetree (no {KEY_VERSION!r} in its "
            "metadata), so it has no tree structure to check against like=. Fix: load it "
            "without like (a flat dict {tensor name: array}, ties= for its tied weights)."
        )
    if atol is not None and ties is None:
        raise TieError(
            f"load: atol={atol!r:.40} without ties= for {label}: atol is how far a present tie "
            "target may differ from its ref, and without ties= nothing is compared. Fix: pass "
            "ties={'lm_head.weight': 'model.embed_tokens.weight'} too, or drop atol."
        )
    asked = {} if ties is None else _parse_ties(ties)
    tensors = {name: _tensor(r, name) for r in readers for name in r.infos}
    file_ties = {k: v for r in readers for k, v in metadata_ties(r.metadata, tensors).items()}
    tree, copies = _apply_ties(label, tensors, file_ties, asked)
    tree = read_tree(label, tree, shardings)  # every check first: shapes, ties, shardings
    _compare(label, tree, copies, asked, 0.0 if atol is None else atol)
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
    else:
        said += (
            ". If the model ties weights that the file omits or stores once (Hugging Face "
            "tie_word_embeddings), pass them: st.load(path, ties={'lm_head.weight': "
            "'model.embed_tokens.weight'}) (transformers 5: ties=model.all_tied_weights_keys); "
            "for ties stored twice, st.find_ties(tree) finds them"
        )
    warnings.warn(
        f"{label} was not written by sharetree (no {KEY_VERSION!r} in its metadata): {said}.",
        stacklevel=3,
    )
    return tree
