"""``save`` / ``load``: one safetensors file per canonical tree, each buffer stored once.

File format (version 1). A standard safetensors file:

* **tensors**: one per buffer (canonical array leaf), named by its ``/``-joined
  path (``encoder/kernel``). Views are *not* stored: they are recomputed on
  demand by :func:`sharetree.materialize`. Dtypes that safetensors has no code
  for (``complex128``, ``float8_*``, ``int4``, ...) are stored as their raw
  bytes (a 1-D ``uint8`` tensor) with the real dtype and shape in the metadata.
* **metadata** (strings, in the safetensors header):

  - ``sharetree.format_version``: ``"1"``; a reader refuses a newer version.
  - ``sharetree.library_version``: the sharetree version that wrote the file
    (informative).
  - ``sharetree.tree``: JSON of the canonical tree's structure. Each node is an
    object with a kind ``"t"``: ``dict`` / ``odict`` (``keys``, ``children``),
    ``list`` / ``tuple`` (``children``), ``none``, ``node`` (any other pytree
    node: its ``type`` name, ``keys`` and ``children``), ``tied`` (``ref``: list
    of keys, ``transform``: the transform's ``spec()``), ``buffer``
    (``tensor``, ``dtype``, ``shape``, ``raw``, ``scalar``), ``value`` (a
    Python ``bool``/``int``/``float``/``complex``/``str`` leaf, kept in the
    JSON), or ``static`` (a leaf no file can hold, such as an activation
    function of an Equinox module: only its path and ``type`` are recorded).

Because ties are data in the JSON and every buffer is one tensor, a loaded
tree has exactly the ``Tied`` nodes of the saved one, and other safetensors
readers see each shared weight once.
"""

from __future__ import annotations

import collections
import json
import math
import os
import warnings
from typing import Any, Union

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from sharetree._errors import TieError
from sharetree._foreign import KEY_VERSION as _KEY_VERSION
from sharetree._foreign import load_foreign
from sharetree._paths import Path, key_name, keypath_to_path, path_str
from sharetree._report import canonicalize
from sharetree._safetensors import Reader, atomic_write
from sharetree._tied import Tied, is_tied
from sharetree._transforms import transform_from_spec

__all__ = ["save", "load", "FORMAT_VERSION"]

FORMAT_VERSION = 1
"""The version of the file format written by :func:`save`; :func:`load` reads versions up to it."""

_KEY_TREE = "sharetree.tree"
_KEY_LIBRARY = "sharetree.library_version"
_RESAVE = (
    "The file was edited or damaged after st.save wrote it. Fix: save the tree again with "
    "st.save, or read its tensors without the tree with safetensors.numpy.load_file(path)."
)

# dtypes that safetensors stores under their own code (and numpy reads back)
_NATIVE = frozenset(
    "bool int8 uint8 int16 uint16 int32 uint32 int64 uint64 "
    "float16 float32 float64 complex64 bfloat16".split()
)
PathOrStr = Union[str, "os.PathLike[str]"]


# ----------------------------------------------------------------------------- save


def _is_numeric(dtype: np.dtype) -> bool:
    """Numbers and booleans, including the ml_dtypes types (bfloat16, float8, int4)."""
    if dtype.kind in "biufc":
        return True
    try:
        return dtype.kind == "V" and dtype.fields is None and jnp.dtype(dtype.name) == dtype
    except TypeError:
        return False


class _Writer:
    """Walks a canonical tree into (JSON structure, {tensor name: array})."""

    def __init__(self) -> None:
        self.tensors: dict[str, np.ndarray] = {}

    def name_for(self, path: Path) -> str:
        base = "/".join(path) if path else "<root>"
        name, k = base, 1
        while name in self.tensors:  # keys containing '/' can make two paths print alike
            name, k = f"{base}~{k}", k + 1
        return name

    def node(self, x: Any, path: Path) -> dict[str, Any]:
        if isinstance(x, Tied):
            try:
                spec = x.transform.spec()
            except TieError as e:
                raise TieError(f"save: the tie at {path_str(path)!r} ({x!r}): {e}") from None
            return {"t": "tied", "ref": list(x.ref), "transform": spec}
        if x is None:
            return {"t": "none"}
        kind = type(x)
        if kind in (dict, collections.OrderedDict):
            keys = list(x.keys())
            for k in keys:
                if type(k) not in (str, int):
                    raise TieError(
                        f"save: the dict at {path_str(path)!r} has the key {k!r} of type "
                        f"{type(k).__name__}; a file can hold str and int keys only. "
                        "Fix: use str or int keys."
                    )
            return {
                "t": "dict" if kind is dict else "odict",
                "keys": keys,
                "children": [self.node(x[k], (*path, str(k))) for k in keys],
            }
        if kind in (list, tuple):
            return {
                "t": kind.__name__,
                "children": [self.node(c, (*path, str(i))) for i, c in enumerate(x)],
            }
        treedef = jtu.tree_structure(x)
        if treedef.num_nodes == 1 and treedef.num_leaves == 1:
            return self.leaf(x, path)
        flat, _ = jtu.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
        keys = [key_name(kp[0]) for kp, _ in flat]
        if len(set(keys)) != len(keys):
            raise TieError(
                f"save: the {kind.__name__} node at {path_str(path)!r} has children with equal "
                f"key names {keys}, so their paths would be ambiguous. Fix: register the node "
                "type with distinct keys (jax.tree_util.register_pytree_with_keys)."
            )
        return {
            "t": "node",
            "type": f"{kind.__module__}.{kind.__qualname__}",
            "keys": keys,
            "children": [self.node(c, (*path, k)) for k, (_, c) in zip(keys, flat, strict=True)],
        }

    def leaf(self, x: Any, path: Path) -> dict[str, Any]:
        if type(x) in (bool, int, float, str):
            return {"t": "value", "type": type(x).__name__, "value": x}
        if type(x) is complex:
            return {"t": "value", "type": "complex", "value": [x.real, x.imag]}
        if isinstance(x, (jax.Array, np.ndarray, np.generic)):
            return self.array(x, path)
        return {"t": "static", "type": f"{type(x).__module__}.{type(x).__qualname__}"}

    def array(self, x: Any, path: Path) -> dict[str, Any]:
        if isinstance(x, jax.core.Tracer):
            raise TieError(
                f"save: the buffer at {path_str(path)!r} has no concrete value (it is traced "
                "by jit/grad/vmap). Fix: call st.save outside jit/grad, on concrete arrays."
            )
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            raise TieError(
                f"save: the buffer at {path_str(path)!r} is sharded over several processes "
                "(not fully addressable here), and st.save writes one file from one process. "
                "Fix: save multi-host trees with Orbax (see docs/saving_and_scaling.md), or "
                "gather the array first (jax.experimental.multihost_utils.process_allgather)."
            )
        a = np.asarray(x)
        if not _is_numeric(a.dtype):
            raise TieError(
                f"save: the array at {path_str(path)!r} has dtype {a.dtype}, which is not a "
                "numeric dtype a safetensors file can hold. Fix: convert it to a numeric array "
                "or keep it out of the tree."
            )
        dtype = a.dtype.name
        if not a.flags.c_contiguous:
            a = a.copy(order="C")  # (np.ascontiguousarray would make 0-d arrays 1-d)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        raw = dtype not in _NATIVE
        name = self.name_for(path)
        self.tensors[name] = np.frombuffer(a.tobytes(), np.uint8) if raw else a
        return {
            "t": "buffer",
            "tensor": name,
            "dtype": dtype,
            "shape": list(a.shape),
            "raw": raw,
            "scalar": isinstance(x, np.generic),
        }


def save(path: PathOrStr, tree: Any) -> None:
    """Write a canonical tree to one safetensors file, each buffer stored once.

    The file holds one tensor per buffer (named by its ``/``-joined path) and,
    in the safetensors metadata, the tree's structure, its ``Tied`` nodes
    (ref and transform) and a format version; see ``docs/saving_and_scaling.md``.
    Python ``bool``/``int``/``float``/``complex``/``str`` leaves are kept in the
    metadata. Leaves that no file can hold (the functions in an Equinox module)
    are recorded by path and type only; :func:`load` takes them from its
    ``like`` template.

    The write is atomic: the file is written to a temporary file in the same
    directory and renamed over ``path`` only when complete, so a failure
    leaves any previous file intact.

    Args:
        path: the file to write (conventionally ``*.safetensors``).
        tree: a canonical tree: dicts, lists, tuples, ``None``, Flax structs,
            Equinox modules, any pytree; arrays may be NumPy or JAX (fully
            addressable: for multi-host sharded trees use Orbax).

    Raises:
        TieError: a bad sharing graph (see :func:`sharetree.canonicalize`), an
            ``st.fn`` transform whose function is not importable by name, a
            dict key that is not ``str``/``int``, a non-numeric array, a
            traced value (inside ``jit``) or an array sharded over several
            processes; nothing is written then.
        OSError: the file cannot be written (the previous file, if any, is kept).

    Example:
        >>> import os, tempfile, numpy as np, sharetree as st
        >>> tree = {"emb": np.arange(6.0).reshape(3, 2), "head": st.Tied("emb", st.T)}
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> st.save(path, tree)
        >>> st.load(path)["head"]
        Tied('emb', T)
    """
    canonicalize(tree).views  # noqa: B018 - validate the graph and every view's shape first
    writer = _Writer()
    structure = writer.node(tree, ())
    from sharetree import __version__

    metadata = {
        _KEY_VERSION: str(FORMAT_VERSION),
        _KEY_LIBRARY: __version__,
        _KEY_TREE: json.dumps(structure, separators=(",", ":"), allow_nan=True),
    }
    atomic_write(os.fspath(path), writer.tensors, metadata)


# ----------------------------------------------------------------------------- load


def load(path: PathOrStr, like: Any = None) -> Any:
    r"""Read a file written by :func:`save`: the canonical tree, every ``Tied`` back.

    Buffers come back as NumPy arrays (NumPy scalars where a NumPy scalar was
    saved); place them with ``jax.device_put(tree, shardings)``, which keeps
    the ties. Dicts, ``OrderedDict``\ s, lists, tuples and ``None`` are rebuilt
    as they were.

    Other pytree nodes (Flax structs, Equinox modules, namedtuples,
    dataclasses) need a template: ``load(path, like=template)`` checks that
    ``template`` has the file's canonical structure (the same paths, a buffer
    of the same shape and dtype at each buffer position, the same ``Tied`` at
    each tie) and returns the file's values in the template's structure; leaves
    the file could not hold (functions of an Equinox module) and static fields
    come from the template. The template's leaves may be arrays or
    ``jax.ShapeDtypeStruct``. Without a template such nodes are rebuilt as
    dicts keyed by their key names (the paths, and so the ties, are the same)
    with a warning.

    A safetensors file without sharetree metadata (written by another tool,
    such as a PyTorch state dict) is loaded as a flat dict ``{tensor name:
    array}`` with a ``UserWarning`` saying so; recover its ties with
    :func:`sharetree.find_ties` and :func:`sharetree.tie`.

    Transforms made with ``st.fn`` are rebuilt by importing their function by
    module and name, so loading such a file imports that module.

    Args:
        path: the file.
        like: optional template tree (see above).

    Returns:
        The canonical tree.

    Raises:
        FileNotFoundError: the file does not exist (other ``OSError``\ s, such
            as a permission error, pass through too).
        TieError: anything wrong with the file's content: empty, truncated or
            not a safetensors file, a directory, a newer format version,
            malformed metadata, an unknown transform, a tensor that is missing
            or of the wrong shape, a missing template for a static leaf, or a
            template that does not match (naming the path). No partial tree is
            ever returned.

    Example:
        >>> import os, tempfile, numpy as np, sharetree as st
        >>> tree = {"enc": {"w": np.ones((2, 3))}, "dec": {"w": st.Tied("enc/w", st.T)}}
        >>> path = os.path.join(tempfile.mkdtemp(), "ae.safetensors")
        >>> st.save(path, tree)
        >>> back = st.load(path)
        >>> back["dec"]["w"], back["enc"]["w"].shape
        (Tied('enc/w', T), (2, 3))
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"load: no such file: {path!r}")
    if os.path.isdir(path):
        return load_foreign(path, like=like)
    reader = Reader(path)
    meta = reader.metadata
    if _KEY_VERSION not in meta:
        return load_foreign(path, like=like)
    version = meta[_KEY_VERSION]
    if not version.isdigit():
        raise TieError(
            f"load: {path!r} has a malformed format version {version!r}; expected a "
            f"decimal integer such as {str(FORMAT_VERSION)!r}. {_RESAVE}"
        )
    if int(version) > FORMAT_VERSION:
        raise TieError(
            f"load: {path!r} has format version {int(version)}, written by sharetree "
            f"{meta.get(_KEY_LIBRARY, '?')}; this sharetree reads versions up to "
            f"{FORMAT_VERSION}. Fix: upgrade sharetree (pip install -U sharetree)."
        )
    if _KEY_TREE not in meta:
        raise TieError(
            f"load: {path!r} has a format version but no {_KEY_TREE!r} metadata, so its tree "
            f"structure is lost. {_RESAVE}"
        )
    try:
        structure = json.loads(meta[_KEY_TREE])
    except ValueError as e:
        raise TieError(
            f"load: the {_KEY_TREE!r} metadata of {path!r} is not valid JSON ({e}). {_RESAVE}"
        ) from None
    tensors = dict(reader.tensors())
    builder = _Builder(path, tensors)
    try:
        tree = builder.build(structure, ())
    except TieError:
        raise
    except Exception as e:  # malformed metadata of any shape
        raise TieError(
            f"load: the metadata of {path!r} is malformed near {path_str(builder.at)!r} "
            f"({type(e).__name__}: {e}). Fix: save the tree again with st.save."
        ) from None
    unused = sorted(set(tensors) - builder.used)
    if unused:
        raise TieError(
            f"load: {path!r} holds tensors that its tree does not use: {unused[:5]}. The file "
            "was changed after st.save wrote it. Fix: save the tree again with st.save."
        )
    if like is not None:
        tree = _restore_like(path, tree, like)
    elif builder.statics:
        where, kind = builder.statics[0]
        raise TieError(
            f"load: {path!r} has {len(builder.statics)} leaf/leaves that a file cannot hold, "
            f"such as {kind} at {path_str(where)!r} (e.g. an Equinox activation function). "
            "Fix: pass a template that supplies them: st.load(path, like=model)."
        )
    elif builder.generic:
        where, kind = builder.generic[0]
        warnings.warn(
            f"{path!r}: {len(builder.generic)} pytree node(s) of types sharetree cannot rebuild "
            f"on its own, such as {kind} at {path_str(where) if where else '<root>'!r}, were "
            "loaded as dicts keyed by their key names (paths and ties are unchanged). Pass "
            "like=template to get the original types.",
            UserWarning,
            stacklevel=2,
        )
    try:
        canonicalize(tree).views  # noqa: B018 - dangling refs, cycles, bad transforms
    except TieError as e:
        raise TieError(f"load: {path!r} holds a bad sharing graph: {e}") from None
    return tree


class _Builder:
    """Rebuilds a canonical tree from the JSON structure and the file's tensors."""

    def __init__(self, path: str, tensors: dict[str, np.ndarray]) -> None:
        self.path = path
        self.tensors = tensors
        self.used: set[str] = set()
        self.statics: list[tuple[Path, str]] = []
        self.generic: list[tuple[Path, str]] = []
        self.at: Path = ()

    def build(self, node: dict[str, Any], path: Path) -> Any:
        self.at = path
        t = node["t"]
        if t == "dict" or t == "odict":
            keys, children = node["keys"], node["children"]
            self._same_length(keys, children, path)
            kind = dict if t == "dict" else collections.OrderedDict
            return kind(
                (k, self.build(c, (*path, str(k)))) for k, c in zip(keys, children, strict=True)
            )
        if t in ("list", "tuple"):
            out = [self.build(c, (*path, str(i))) for i, c in enumerate(node["children"])]
            return out if t == "list" else tuple(out)
        if t == "none":
            return None
        if t == "node":
            keys, children = node["keys"], node["children"]
            self._same_length(keys, children, path)
            self.generic.append((path, node["type"]))
            return {
                str(k): self.build(c, (*path, str(k))) for k, c in zip(keys, children, strict=True)
            }
        if t == "tied":
            try:
                transform = transform_from_spec(node["transform"])
            except TieError as e:
                fix = "" if "Fix:" in str(e) else f" {_RESAVE}"
                raise TieError(
                    f"load: {self.path!r}: the tie at {path_str(path)!r} cannot be rebuilt: "
                    f"{e}{fix}"
                ) from None
            return Tied(tuple(str(k) for k in node["ref"]), transform)
        if t == "value":
            return self.value(node, path)
        if t == "static":
            self.statics.append((path, node["type"]))
            return _Static(node["type"])
        if t == "buffer":
            return self.buffer(node, path)
        raise TieError(
            f"load: {self.path!r}: unknown node kind {t!r} at {path_str(path)!r}; the file may "
            "come from a newer sharetree. Fix: upgrade sharetree."
        )

    def _same_length(self, keys: list[Any], children: list[Any], path: Path) -> None:
        if len(keys) != len(children) or len(set(map(str, keys))) != len(keys):
            raise TieError(
                f"load: {self.path!r}: malformed node at {path_str(path)!r}: expected as many "
                f"distinct keys as children, found keys {keys!r} for {len(children)} "
                f"children. {_RESAVE}"
            )

    def value(self, node: dict[str, Any], path: Path) -> Any:
        kind, v = node["type"], node["value"]
        if kind == "complex":
            return complex(*v)
        types = {"bool": bool, "int": int, "float": float, "str": str}
        if kind not in types or not isinstance(v, (types[kind], int)):
            raise TieError(
                f"load: {self.path!r}: malformed value {v!r} at {path_str(path)!r}: expected "
                f"a value of type {kind!r} (one of bool, int, float, complex, str). {_RESAVE}"
            )
        return types[kind](v)

    def buffer(self, node: dict[str, Any], path: Path) -> Any:
        name = node["tensor"]
        if name not in self.tensors:
            raise TieError(
                f"load: {self.path!r}: the buffer at {path_str(path)!r} needs the tensor "
                f"{name!r}, which the file does not hold. Fix: save the tree again with st.save."
            )
        if name in self.used:
            raise TieError(
                f"load: {self.path!r}: the tensor {name!r} is used twice (again at "
                f"{path_str(path)!r}); each buffer has a tensor of its own. {_RESAVE}"
            )
        self.used.add(name)
        a = self.tensors[name]
        dtype, shape = jnp.dtype(node["dtype"]), tuple(int(s) for s in node["shape"])
        if node["raw"]:
            if a.dtype != np.uint8 or a.size != math.prod(shape) * dtype.itemsize:
                raise TieError(
                    f"load: {self.path!r}: tensor {name!r} should hold the raw bytes of "
                    f"{dtype.name}{list(shape)}, found {a.dtype.name}{list(a.shape)}. {_RESAVE}"
                )
            a = np.frombuffer(a.tobytes(), dtype).reshape(shape)
        elif a.dtype != dtype or a.shape != shape:
            raise TieError(
                f"load: {self.path!r}: tensor {name!r} at {path_str(path)!r} is "
                f"{a.dtype.name}{list(a.shape)} but the metadata says {dtype.name}{list(shape)}. "
                f"{_RESAVE}"
            )
        return a[()] if node.get("scalar") else a


class _Static:
    """Placeholder for a leaf a file could not hold; replaced from the template."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __repr__(self) -> str:
        return f"<unsaved {self.kind}>"


def _describe_leaf(x: Any) -> str:
    if isinstance(x, Tied):
        return repr(x)
    if isinstance(x, _Static):
        return f"an unsaved {x.kind} leaf"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"a buffer {np.dtype(x.dtype).name}{list(np.shape(x))}"
    return f"{type(x).__name__} {x!r}"


def _restore_like(path: str, tree: Any, like: Any) -> Any:
    file_flat, _ = jtu.tree_flatten_with_path(tree, is_leaf=is_tied)
    got = {keypath_to_path(kp): x for kp, x in file_flat}
    tmpl_flat, _ = jtu.tree_flatten_with_path(like, is_leaf=is_tied)
    want = {keypath_to_path(kp): x for kp, x in tmpl_flat}
    if got.keys() != want.keys():
        only_file = sorted(map(path_str, got.keys() - want.keys()))
        only_tmpl = sorted(map(path_str, want.keys() - got.keys()))
        raise TieError(
            f"load: the template (like=) does not match {path!r}: paths only in the file: "
            f"{only_file[:5] or 'none'}; only in the template: {only_tmpl[:5] or 'none'}. "
            "Fix: pass a template of the same model and configuration, tied the same way."
        )
    leaves: list[Any] = []
    for kp, t in tmpl_flat:
        p = keypath_to_path(kp)
        f = got[p]
        where = path_str(p)
        if isinstance(t, Tied) or isinstance(f, Tied):
            if not (isinstance(t, Tied) and isinstance(f, Tied) and t == f):
                fix = (
                    f"tie the template the same way: st.tie(template, {{{where!r}: {f!r}}})"
                    if isinstance(f, Tied) and not isinstance(t, Tied)
                    else "tie the template as the saved tree was tied"
                )
                raise TieError(
                    f"load: the template (like=) does not match {path!r} at {where!r}: the file "
                    f"has {_describe_leaf(f)}, the template has {_describe_leaf(t)}. Fix: {fix}."
                )
            continue
        if isinstance(f, _Static):
            leaves.append(t)
            continue
        if hasattr(t, "shape") and hasattr(t, "dtype"):
            ok = isinstance(f, (np.ndarray, np.generic)) and (
                tuple(np.shape(f)) == tuple(t.shape) and np.dtype(f.dtype) == np.dtype(t.dtype)
            )
        else:
            ok = type(f) is type(t)
        if not ok:
            raise TieError(
                f"load: the template (like=) does not match {path!r} at {where!r}: the file has "
                f"{_describe_leaf(f)}, the template has {_describe_leaf(t)}. Fix: pass a "
                "template of the same model and configuration (shapes and dtypes)."
            )
        leaves.append(f)
    treedef = jtu.tree_structure(like)
    return jtu.tree_unflatten(treedef, leaves)
