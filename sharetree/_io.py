"""``save`` / ``load``: one safetensors file per canonical tree, each buffer once.

The format is specified in ``docs/saving_and_scaling.md`` ("The file format").
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Union

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from sharetree._errors import TieError, bounded, one_line, safe_repr
from sharetree._foreign import load_foreign
from sharetree._format import (
    FORMAT_VERSION,
    KEY_LIBRARY,
    KEY_TREE,
    KEY_VERSION,
    LIBRARY_VERSION,
    PREFIX,
)
from sharetree._materialize import abstract_expanded
from sharetree._paths import Path, TieMap, format_aval, key_name, leaves_with_paths, path_str
from sharetree._safetensors import (
    NATIVE_CODES,
    DuplicateKey,
    Pending,
    Reader,
    Tensor,
    _only,
    atomic_write,
    file_path,
    read_tree,
    unique_pairs,
)
from sharetree._tied import Tied, is_tied
from sharetree._transforms import (
    _is_int,
    _is_real,
    describe_transform,
    is_described,
    transform_from_spec,
)

__all__ = ["save", "load", "read_metadata", "FORMAT_VERSION", "MAX_DEPTH", "KEY_IMPLS"]

MAX_DEPTH = 200
"""The deepest nesting of containers :func:`save` writes and :func:`load` reads (the root is 0)."""

KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
"""The PRNG implementations of typed key arrays (``jax.random.key``) a file may hold."""

_RESAVE = (
    "The file was edited or damaged after st.save wrote it. Fix: save the tree again with "
    "st.save, or read its tensors without the tree with safetensors.numpy.load_file(path)."
)

_CONTAINERS = {"dict": dict, "odict": collections.OrderedDict, "list": list, "tuple": tuple}
"""The node kinds of the containers a file rebuilds on its own."""
_KIND_OF: dict[type, Any] = {kind: t for t, kind in _CONTAINERS.items()}
PathOrStr = Union[str, "os.PathLike[str]"]


# ----------------------------------------------------------------------------- save


def _is_numeric(dtype: np.dtype) -> bool:
    """Numbers and booleans, including the ml_dtypes types (bfloat16, float8, int4)."""
    return dtype.kind in "biufc" or (dtype.kind == "V" and bool(jnp.issubdtype(dtype, jnp.number)))


def _addressable(x: jax.Array) -> bool:
    """Whether this process holds every shard of ``x`` (a seam for tests)."""
    return bool(x.is_fully_addressable)


def _spec(x: Tied, path: Path) -> Any:
    """The spec of the transform of ``x``, checked to be JSON before anything is written."""

    def where() -> str:  # shown only on an error (a repr may be costly)
        return f"save: the tie at {path_str(path)!r} ({safe_repr(x, 1000)})"

    try:
        spec = x.transform.spec()
    except TieError as e:
        raise TieError(f"{where()}: {e}") from None
    except Exception as e:  # a user transform's own spec()
        raise TieError(
            f"{where()}: its spec() raised {one_line(e)}. Fix: make spec() "
            "return a dict of JSON values (see Transform.spec)."
        ) from e

    def bad(v: Any) -> str | None:
        try:
            json.dumps(v, allow_nan=True)
        except (TypeError, ValueError) as e:
            return one_line(e)
        return None

    why = bad(spec)
    if why is None:
        try:  # what a file holds must read back as this transform (given its classes)
            back = describe_transform(json.loads(json.dumps(spec, allow_nan=True)))
        except TieError as e:
            raise TieError(f"{where()}: its spec would not load: {e}") from None
        if is_described(back) or back == x.transform:  # fn: its function is named, not read
            return spec
        raise TieError(
            f"{where()}: its spec reads back as {safe_repr(back, 200)}, not as the transform "
            "itself, so a file would hold another transform. Fix: give the class's fields "
            "annotations that from_spec can resolve at module level (not local classes), "
            "or define the class's spec() and from_spec()."
        )
    items = spec.items() if isinstance(spec, dict) else []
    field = next(((k, v) for k, v in items if bad(v) is not None and isinstance(k, str)), None)
    what = (
        f"its field {field[0]!r} holds {type(field[1]).__name__} {safe_repr(field[1], 60)}, "
        "which is not JSON"
        if field is not None
        else f"its spec {safe_repr(spec)} is not a JSON object"
    )
    raise TieError(
        f"{where()}: {what} ({why}); a spec holds str, int, float, bool, None and lists and "
        "dicts of them (complex numbers and transforms are written as such by the default "
        "spec()). Fix: store a JSON value in the field (e.g. a dtype's name, converted in "
        "__post_init__), or define the transform's spec() and from_spec()."
    )


class _Writer:
    """Walks a canonical tree into (JSON structure, {tensor name: array})."""

    def __init__(self, gather: bool) -> None:
        self.tensors: dict[str, np.ndarray] = {}
        self.gather, self.has_keys = gather, False

    def name_for(self, path: Path) -> str:
        # lone surrogates: a file holds UTF-8 names only
        base = "/".join(path).encode("utf-8", "backslashreplace").decode() if path else "<root>"
        name, k = base, 1
        # keys containing '/' can make two paths print alike; '__metadata__' is reserved
        while name in self.tensors or name == "__metadata__":
            name, k = f"{base}~{k}", k + 1
        return name

    def node(self, x: Any, path: Path) -> dict[str, Any]:
        if len(path) > MAX_DEPTH:
            raise TieError(
                f"save: the tree is nested deeper than {MAX_DEPTH} levels (at "
                f"{path_str(path[:8])!r}/...); a file holds at most {MAX_DEPTH} levels, so that "
                "every reader can rebuild it without deep recursion. Fix: flatten the tree."
            )
        if isinstance(x, Tied):
            return {"t": "tied", "ref": list(x.ref), "transform": _spec(x, path)}
        if x is None:
            return {"t": "none"}
        kind, t = type(x), _KIND_OF.get(type(x))
        if t in ("list", "tuple"):
            node, keys, values = {"t": t}, [str(i) for i in range(len(x))], list(x)
        elif t is not None:
            keys = list(x.keys())
            seen: dict[str, Any] = {}
            for k in keys:
                if type(k) not in (str, int):
                    raise TieError(
                        f"save: the dict at {path_str(path)!r} has the key {k!r} of type "
                        f"{type(k).__name__}; a file can hold str and int keys only. "
                        "Fix: use str or int keys."
                    )
                _check_int(k, path, "a dict key")
                if str(k) in seen:
                    raise TieError(
                        f"save: the dict at {path_str(path)!r} has the keys {seen[str(k)]!r} and "
                        f"{k!r}, which name the same path {path_str((*path, str(k)))!r}. "
                        "Fix: rename one key so that paths are unambiguous."
                    )
                seen[str(k)] = k
            node, values = {"t": t, "keys": keys}, [x[k] for k in keys]
        elif not jtu.all_leaves([x]):  # any other pytree node: its children by their key names
            flat, _ = jtu.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
            keys, values = [key_name(kp[0]) for kp, _ in flat], [c for _, c in flat]
            if len(set(keys)) != len(keys):
                raise TieError(
                    f"save: the {kind.__name__} node at {path_str(path)!r} has children with "
                    f"equal key names {keys}, so their paths would be ambiguous. Fix: register "
                    "the node type with distinct keys (jax.tree_util.register_pytree_with_keys)."
                )
            node = {"t": "node", "type": f"{kind.__module__}.{kind.__qualname__}", "keys": keys}
        elif kind in (bool, int, float, str, complex):
            _check_int(x, path, "the leaf")
            value = [x.real, x.imag] if kind is complex else x
            return {"t": "value", "type": kind.__name__, "value": value}
        elif isinstance(x, (np.ndarray, np.generic, jax.Array)):
            return self.array(x, path)
        elif hasattr(x, "shape") and hasattr(x, "dtype"):  # a static would drop its values
            raise TieError(
                f"save: the leaf at {path_str(path)!r} is a {kind.__name__} of shape "
                f"{x.shape}, not an array with values a file can hold "
                "(jax.ShapeDtypeStruct: an abstract tree). Fix: save concrete NumPy or JAX "
                "arrays (np.asarray(x) for other array types)."
            )
        else:
            return {"t": "static", "type": f"{kind.__module__}.{kind.__qualname__}"}
        children = [self.node(c, (*path, str(k))) for k, c in zip(keys, values)]
        return {**node, "children": children}

    def array(self, x: Any, path: Path) -> dict[str, Any]:
        if isinstance(x, jax.core.Tracer):
            raise TieError(
                f"save: the buffer at {path_str(path)!r} has no concrete value (it is traced "
                "by jit/grad/vmap). Fix: call st.save outside jit/grad, on concrete arrays."
            )
        if isinstance(x, jax.Array) and x.is_deleted():
            raise TieError(
                f"save: the buffer at {path_str(path)!r} has been deleted (donated to a jitted "
                "call with donate_argnums, or x.delete()), so it has no value to write. Fix: "
                "save the tree the donating call returned."
            )
        impl = None
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            impl = str(jax.random.key_impl(x))
            if impl not in KEY_IMPLS:
                raise TieError(
                    f"save: the PRNG key array at {path_str(path)!r} uses the implementation "
                    f"{impl!r}; a file can hold keys of {', '.join(KEY_IMPLS)} only. Fix: store "
                    "its raw data (jax.random.key_data) and wrap it again after loading."
                )
            x = jax.random.key_data(x)
            self.has_keys = True
        if isinstance(x, jax.Array) and not _addressable(x):
            if not self.gather:
                raise TieError(
                    f"save: the buffer at {path_str(path)!r} is sharded over several processes "
                    "(not fully addressable here), and st.save writes one file. Fix: call "
                    "st.save(path, tree, gather=True) on every process (buffers are gathered "
                    "and process 0 writes), or save with Orbax (docs/saving_and_scaling.md)."
                )
            from jax.experimental import multihost_utils

            x = multihost_utils.process_allgather(x, tiled=True)
        if isinstance(x, np.ma.MaskedArray) and np.ma.getmask(x) is not np.ma.nomask:
            raise TieError(
                f"save: the array at {path_str(path)!r} is a masked array; a file would hold its "
                "data without the mask. Fix: save data and mask as two arrays "
                "(x.data, np.ma.getmaskarray(x)) or fill it (x.filled())."
            )
        a = np.asarray(x)
        if not _is_numeric(a.dtype):
            raise TieError(
                f"save: the array at {path_str(path)!r} has dtype {a.dtype}, which is not a "
                "numeric dtype a safetensors file can hold. Fix: convert it to a numeric array "
                "or keep it out of the tree."
            )
        dtype = a.dtype.name  # C order, little-endian: a copy only where needed
        a = a.astype(a.dtype.newbyteorder("<"), order="C", copy=False)
        raw = dtype not in NATIVE_CODES.values()  # stored as bytes: no code of its own
        name = self.name_for(path)
        self.tensors[name] = np.frombuffer(a.tobytes(), np.uint8) if raw else a
        scalar = isinstance(x, np.generic)
        node = {"t": "buffer", "tensor": name, "dtype": dtype, "shape": list(a.shape), "raw": raw}
        return {**node, "scalar": scalar, **({} if impl is None else {"key": impl})}


def _check_int(x: Any, path: Path, what: str) -> None:
    """A TieError for an ``int`` too long for the JSON text of a file (Python's digit limit)."""
    if type(x) is int:
        try:
            str(x)
        except ValueError:
            raise TieError(
                f"save: {what} at {path_str(path)!r} is an int of {x.bit_length():,} bits, more "
                f"than the {sys.get_int_max_str_digits():,} decimal digits Python writes and "
                "reads as text (a file holds ints as JSON text). Fix: store it as a str or an "
                "array."
            ) from None


def _check_user_metadata(metadata: Any) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TieError(
            f"save: metadata must be a dict of str -> str, found {type(metadata).__name__}. "
            'Fix: pass e.g. metadata={"format": "pt"}.'
        )
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TieError(
                f"save: the metadata entry {k!r}: {v!r} is {type(k).__name__} -> "
                f"{type(v).__name__}; safetensors metadata holds str -> str only. "
                "Fix: convert it, e.g. with json.dumps."
            )
        try:
            (k + v).encode("utf-8")
        except UnicodeEncodeError:
            raise TieError(
                f"save: the metadata entry {k!r}: {v!r} is not valid UTF-8 text (it holds a lone "
                "surrogate). Fix: pass text that encodes to UTF-8."
            ) from None
        if k.startswith(PREFIX):
            raise TieError(
                f"save: the metadata key {k!r} starts with {PREFIX!r}, which sharetree keeps "
                "for its own entries. Fix: choose another key, e.g. without the prefix."
            )
    return dict(metadata)


def save(
    path: PathOrStr,
    tree: Any,
    *,
    metadata: Mapping[str, str] | None = None,
    gather: bool = False,
) -> None:
    """Write a canonical tree to one safetensors file, each buffer stored once.

    Every check runs before anything is written, and the write is atomic.
    Details: ``docs/saving_and_scaling.md``.

    Args:
        path: the file to write (conventionally ``*.safetensors``).
        tree: a canonical tree (any pytree; NumPy or JAX arrays).
        metadata: extra ``str -> str`` entries (``sharetree.*`` keys are
            reserved), read back by :func:`read_metadata`.
        gather: ``True`` gathers buffers sharded over several processes and
            process 0 writes, so **every process must call** ``save``; every
            process returns once the file exists. ``False``: such a buffer
            is an error.

    Raises:
        TieError: any tree, argument or path that cannot be saved; nothing is
            written.
        OSError: the file cannot be written (a previous file is kept).

    Example:
        >>> import os, tempfile, numpy as np, sharetree as st
        >>> tree = {"emb": np.arange(6.0).reshape(3, 2), "head": st.Tied("emb", st.T)}
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> st.save(path, tree)
        >>> st.load(path)["head"]
        Tied('emb', T)
    """
    path = file_path(path, "save")
    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        raise TieError(
            f"save: {path!r} is a directory; st.save writes one file. Fix: give a file name, "
            f"e.g. {os.path.join(path, 'model.safetensors')!r}."
        )
    if not isinstance(gather, (bool, np.bool_)):
        raise TieError(
            f"save: gather must be True or False, found {type(gather).__name__} {gather!r:.80}. "
            "Fix: pass gather=True for arrays sharded over several processes, else leave it out."
        )
    user = _check_user_metadata(metadata)
    writer = _Writer(bool(gather))
    structure = writer.node(tree, ())  # keys, depth and leaves first: names the path
    try:
        jtu.tree_structure(tree)
    except (ValueError, TypeError) as e:  # jax cannot sort the keys (e.g. dict keys 0 and "a")
        raise TieError(
            f"save: jax cannot flatten the tree ({one_line(e)}). Fix: use dict keys of one "
            "type per dict (all str or all int)."
        ) from e
    abstract_expanded(tree)  # validate the graph and every view's shape first
    meta = {
        **user,
        KEY_VERSION: "2" if writer.has_keys else "1",
        KEY_LIBRARY: LIBRARY_VERSION,
        KEY_TREE: json.dumps(structure, separators=(",", ":"), allow_nan=True),
    }
    from safetensors import SafetensorError

    try:
        if jax.process_index() == 0:
            atomic_write(path, writer.tensors, meta)
    except SafetensorError as e:  # a header over the 100 MB that every safetensors reader takes
        raise TieError(
            f"save: safetensors cannot write {path!r} ({one_line(e)}); its header would hold "
            f"{len(meta[KEY_TREE]):,} bytes of tree JSON (structure, str leaves) and "
            f"{sum(len(k) + len(v) for k, v in user.items()):,} of metadata=, and no reader "
            "takes a header over 100 MB. Nothing was written. Fix: store large text as arrays "
            "or keep it out of the tree and metadata."
        ) from e
    finally:  # with gather, every process returns once the file is there (even if it failed)
        if writer.gather and jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"sharetree.save {path}")


# ----------------------------------------------------------------------------- load


def read_metadata(path: PathOrStr) -> dict[str, str]:
    """The metadata entries of a safetensors file other than sharetree's own (``sharetree.*``)."""
    meta = Reader(file_path(path, "read_metadata"), "read_metadata").metadata
    return {k: v for k, v in meta.items() if not k.startswith(PREFIX)}


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
    checkpoint) loads as a flat dict ``{tensor name: array}`` with a warning.
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
    if functions is not None and not isinstance(functions, Mapping):
        raise TieError(
            "load: functions must be a mapping {'module:qualname': function}, found "
            f"{type(functions).__name__} {functions!r:.80}. "
            "Fix: pass e.g. functions={'mylib.ops:softcap': softcap}."
        )
    if not os.path.exists(path):
        raise FileNotFoundError(f"load: no such file: {path!r}")
    reader = None if os.path.isdir(path) else Reader(path)
    if reader is None or KEY_VERSION not in reader.metadata:
        return load_foreign(path, like, ties, atol, shardings, reader)
    if ties is not None or atol is not None:
        raise TieError(
            f"load: {path!r} was written by st.save and carries its own ties; ties= (and "
            "atol=) are for files that other tools wrote. Fix: drop them, or tie the loaded "
            "tree with st.tie."
        )
    builder = _Builder(reader, functions, lazy=True)
    tree = builder.run()  # buffers not read yet: every check first, then one pass over the file
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
        boxes = any("Partitioned" in k for _, k in builder.generic)
        hint = (
            " (Flax partition boxes: model.apply fails on these dicts; pass "
            "like=jax.eval_shape(lambda: model.init(key, x))['params'])."
        )
        warnings.warn(
            f"{path!r}: {len(builder.generic)} pytree node(s) of types sharetree cannot rebuild "
            f"on its own, such as {kind} at {path_str(where)!r}, were loaded as dicts keyed by "
            "their key names (paths and ties are unchanged). Pass like=template to get the "
            f"original types{hint if boxes else '.'}",
            stacklevel=2,
        )
    try:  # dangling refs, cycles, bad transforms; only the caller's functions are ever called
        abstract_expanded(tree)
    except TieError as e:
        raise TieError(f"load: {path!r} holds a bad sharing graph: {e}") from None
    return read_tree(repr(path), tree, shardings)


# ----------------------------------------------------------------------------- the builder


class _Builder:
    """Rebuilds a canonical tree from a file's JSON structure, trusting none of it.

    Buffers become :class:`_Buffer` leaves (``lazy``) or ``jax.ShapeDtypeStruct``
    leaves; every error names the file, the node's path and the field.
    """

    def __init__(self, reader: Reader, functions: Any, lazy: bool = False) -> None:
        self.path, self.verb, self.meta = reader.path, reader.verb, reader.metadata
        self.reader, self.tensors, self.lazy = reader, reader.infos, lazy
        self.resolve = functools.partial(transform_from_spec, functions=functions)
        self.used: set[str] = set()
        self.statics: list[tuple[Path, str]] = []
        self.generic: list[tuple[Path, str]] = []
        self.keys: list[Path] = []

    def run(self) -> Any:
        version, where = self.meta[KEY_VERSION], f"{self.verb}: {self.path!r}"
        of_tree = f"{self.verb}: the {KEY_TREE!r} metadata of {self.path!r}"
        if not (version.isascii() and version.isdigit() and len(version) < 10) or not int(version):
            raise TieError(
                f"{where} has a malformed format version {_shown(version)}; expected a decimal "
                f"integer from 1, such as {str(FORMAT_VERSION)!r}. {_RESAVE}"
            )
        self.version = int(version)
        if self.version > FORMAT_VERSION:
            raise TieError(
                f"{where} has format version {self.version}, written by sharetree "
                f"{self.meta.get(KEY_LIBRARY, '?')!r}; this sharetree reads versions up to "
                f"{FORMAT_VERSION}. Fix: upgrade sharetree (pip install -U sharetree)."
            )
        if KEY_TREE not in self.meta:
            raise TieError(
                f"{where} has a format version but no {KEY_TREE!r} metadata, so its tree "
                f"structure is lost. {_RESAVE}"
            )
        try:
            tree = self.build(json.loads(self.meta[KEY_TREE], object_pairs_hook=unique_pairs), ())
        except DuplicateKey as e:  # the parser keeps the last of two: a silent pick
            raise TieError(
                f"{of_tree} names the field {e.key!r} twice in one object, so one of the two "
                f"would be silently lost. {_RESAVE}"
            ) from None
        except RecursionError:  # in the parser, or a value nested almost as deep, echoed
            raise TieError(
                f"{of_tree} is nested deeper than Python recurses; a file written by st.save "
                f"holds a tree of at most {MAX_DEPTH} levels. {_RESAVE}"
            ) from None
        except TieError:
            raise
        except ValueError as e:
            raise TieError(f"{of_tree} is not valid JSON ({one_line(e)}). {_RESAVE}") from e
        unused = sorted(set(self.tensors) - self.used)
        if unused:
            raise TieError(
                f"{where} holds tensors that its tree does not use: {unused[:5]}. {_RESAVE}"
            )
        return tree

    def fail(self, what: str, fix: str = _RESAVE) -> TieError:
        return TieError(f"{self.verb}: {self.path!r}: {what} {fix}".rstrip())

    def bad(self, path: Path, what: str) -> TieError:
        return self.fail(f"malformed node at {path_str(path)!r}: {what}.")

    def check(self, ok: bool, path: Path, name: str, v: Any, want: str) -> Any:
        """``v``, the field ``name`` of the node at ``path``, if ``ok``; else a TieError."""
        if not ok:
            found = f"{type(v).__name__} {_shown(v)}"
            raise self.bad(path, f"the field {name!r} should be {want}, found {found}")
        return v

    def build(self, node: Any, path: Path) -> Any:
        if len(path) > MAX_DEPTH:
            raise self.bad(path[:8], f"the tree is nested deeper than {MAX_DEPTH} levels")
        if not isinstance(node, dict):
            raise self.bad(path, f"expected a JSON object, found {type(node).__name__}")
        try:
            return self.node(node, path)
        except KeyError as e:  # only a node's own fields are looked up by indexing
            raise self.bad(path, f"the field {e.args[0]!r} is missing") from None

    def node(self, node: dict[str, Any], path: Path) -> Any:
        t = node["t"]
        self.check(isinstance(t, str), path, "t", t, "a node kind")
        if t == "none":
            return None
        if t in ("static", "tied", "value", "buffer"):
            return getattr(self, t)(node, path)
        if t not in _CONTAINERS and t != "node":
            raise self.fail(
                f"unknown node kind {_shown(t)} at {path_str(path)!r}; the file may come from a "
                "newer sharetree. Fix: upgrade sharetree.",
                "",
            )
        if t == "node":  # rebuilt as a dict keyed by its key names (a warning says so)
            self.generic.append((path, self.type_name(node, path)))
        children = node["children"]
        self.check(isinstance(children, list), path, "children", children, "a list of nodes")
        sequence = t in ("list", "tuple")
        keys = list(range(len(children))) if sequence else node["keys"]
        ok = isinstance(keys, list) and all(type(k) in (str, int) for k in keys)
        self.check(ok, path, "keys", keys, "a list of str or int keys")
        if len(keys) != len(children) or len(set(map(str, keys))) != len(keys):
            raise self.bad(
                path,
                f"expected as many distinct keys as children, found keys {keys[:8]!r} for "
                f"{len(children)} children",
            )
        if t == "dict" and len({type(k) for k in keys}) > 1:
            raise self.bad(
                path,
                f"a dict has keys of one type (jax sorts them), found str and int keys "
                f"{keys[:8]!r}",
            )
        values = [self.build(c, (*path, str(k))) for k, c in zip(keys, children)]
        if sequence:
            return _CONTAINERS[t](values)
        return _CONTAINERS.get(t, dict)(zip(map(str, keys) if t == "node" else keys, values))

    def type_name(self, node: dict[str, Any], path: Path) -> str:
        """A ``module.qualname`` as ``save`` writes it (printable: it is shown in messages)."""
        v = node["type"]
        ok = isinstance(v, str) and 0 < len(v) <= 500 and v.isprintable()
        return self.check(ok, path, "type", v, "a type name (printable, at most 500 characters)")

    def static(self, node: dict[str, Any], path: Path) -> _Static:
        self.statics.append((path, self.type_name(node, path)))
        return _Static(self.statics[-1][1])

    def tied(self, node: dict[str, Any], path: Path) -> Tied:
        ref, spec, where = node["ref"], node["transform"], path_str(path)
        self.check(isinstance(ref, list), path, "ref", ref, "a non-empty list of keys")
        try:
            transform = self.resolve(spec)
        except TieError as e:
            fix = "" if "Fix:" in str(e) else _RESAVE
            what = f"the tie at {where!r} cannot be rebuilt from its field 'transform': {e}"
            raise self.fail(what, fix) from e.__cause__  # a user from_spec's own error
        try:
            return Tied(tuple(ref), transform)
        except TieError as e:
            raise self.fail(f"the tie at {where!r} is malformed: its field 'ref': {e}") from None

    def value(self, node: dict[str, Any], path: Path) -> Any:
        kind, v = node["type"], node["value"]
        ok = isinstance(kind, str) and kind in _VALUE_TYPES
        self.check(ok, path, "type", kind, "bool, int, float, complex or str")
        self.check(_VALUE_TYPES[kind](v), path, "value", v, f"a {kind} value")
        if kind == "complex":
            return complex(*v)
        return float(v) if kind == "float" else v

    def buffer(self, node: dict[str, Any], path: Path) -> Any:
        name, dtype_name, shape, raw = node["tensor"], node["dtype"], node["shape"], node["raw"]
        self.check(_is_dtype_name(dtype_name), path, "dtype", dtype_name, "a numeric dtype name")
        ok = isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
        self.check(ok, path, "shape", shape, "a list of sizes >= 0")
        self.check(type(raw) is bool, path, "raw", raw, "true or false")
        scalar = node.get("scalar", False)
        if not isinstance(scalar, bool) or (scalar and shape):
            raise self.bad(
                path,
                f"the field 'scalar' should be true (for shape []) or false, "
                f"found {_shown(scalar)} for shape {_shown(shape)}",
            )
        impl = node.get("key")
        if impl is not None and (
            self.version < 2 or impl not in KEY_IMPLS or dtype_name != "uint32" or raw
        ):
            raise self.bad(
                path,
                f"the field 'key' should be one of {list(KEY_IMPLS)} on uint32 data in a file "
                f"of format version 2, found {_shown(impl)} on {dtype_name} "
                f"(version {self.version})",
            )
        if not isinstance(name, str) or name not in self.tensors:
            raise self.fail(
                f"the buffer at {path_str(path)!r} needs the tensor {_shown(name)}, which the file "
                "does not hold."
            )
        if name in self.used:
            raise self.fail(
                f"the tensor {name!r} is used twice (again at {path_str(path)!r}); each buffer "
                "has a tensor of its own."
            )
        self.used.add(name)
        want, found = jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype_name)), self.tensors[name]
        got = f"{NATIVE_CODES.get(found.code, found.code)}{list(found.shape)}"  # as format_aval
        shown, where = _shown(None, format_aval(want)), f"tensor {name!r} at {path_str(path)!r}"
        if raw and got != f"uint8[{want.size * want.dtype.itemsize}]":
            raise self.fail(f"{where} should hold the raw bytes of {shown}, found {got}.")
        if not raw and got != format_aval(want):
            raise self.fail(f"{where} is {got} but the metadata says {shown}.")
        if impl is not None:
            self.keys.append(path)
        if not self.lazy:
            return want
        aval = want
        if impl is not None:
            try:
                aval = jax.eval_shape(functools.partial(jax.random.wrap_key_data, impl=impl), want)
            except (ValueError, TypeError) as e:
                what = f"key data {format_aval(want)} does not fit {impl} keys ({one_line(e)})"
                raise self.bad(path, what) from e
        tensor = Tensor(self.reader, name, want.shape, want.dtype, view=raw)
        return _Buffer(tensor, aval.shape, aval.dtype, scalar, impl)


def _shown(v: Any, text: str | None = None) -> str:
    """``repr(v)`` (or ``text``), cut to 60 characters: a file's content is never echoed whole."""
    text = repr(v) if text is None else text
    return text if len(text) <= 60 else text[:57] + "..."


_VALUE_TYPES: dict[str, Callable[[Any], bool]] = {
    "bool": lambda v: isinstance(v, bool),
    "int": _is_int,
    "float": _is_real,
    "str": lambda v: isinstance(v, str),
    "complex": lambda v: isinstance(v, list) and len(v) == 2 and all(map(_is_real, v)),
}
"""The Python leaves a file holds: each ``value`` node's type and the check of its value."""


def _is_dtype_name(v: Any) -> bool:
    """A numeric dtype's name, as ``jnp.dtype`` reads it (``"float32"``, never ``"f4"``)."""
    if not isinstance(v, str) or not v.isidentifier():  # numpy parses more (SyntaxError)
        return False
    try:
        d = jnp.dtype(v)
    except TypeError:
        return False
    return d.name == v and _is_numeric(d)


@dataclasses.dataclass(frozen=True, eq=False)
class _Buffer(Pending):
    """A buffer of a file, not read yet: shape and dtype of what :meth:`read` gives."""

    tensor: Tensor
    shape: tuple[int, ...]
    dtype: Any
    scalar: bool = False  # a NumPy scalar (np.float32(1.0)) on the host
    key: str | None = None  # typed PRNG keys of this implementation, from their key data

    def _wrap(self, data: jax.Array) -> jax.Array:
        return jax.random.wrap_key_data(data, impl=self.key)

    def read(self) -> Any:
        a = self.tensor.read()
        if self.key is not None:
            return self._wrap(jnp.asarray(a))
        return a[()] if self.scalar else a

    def place(self, sharding: Any) -> jax.Array:
        return self.tensor.place(sharding, None if self.key is None else self._wrap)


@dataclasses.dataclass(frozen=True)
class _Static:
    """Placeholder for a leaf a file could not hold; replaced from the template."""

    kind: str

    def __repr__(self) -> str:
        return f"<unsaved {self.kind}>"


def _describe_leaf(x: Any) -> str:
    if isinstance(x, Tied):
        return repr(x)
    if isinstance(x, _Static):
        return f"an unsaved {x.kind} leaf"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"a buffer {x.dtype}{list(x.shape)}"
    return f"{type(x).__name__} {x!r}"


def _restore_like(path: str, tree: Any, like: Any) -> Any:
    got, tmpl = dict(leaves_with_paths(tree, is_tied)), leaves_with_paths(like, is_tied)
    if got.keys() != dict(tmpl).keys():
        raise TieError(
            f"load: the template (like=) does not match {path!r}: paths only in the file: "
            f"{_only(got, dict(tmpl))}; only in the template: {_only(dict(tmpl), got)}. "
            "Fix: pass a template of the same model and configuration, tied the same way."
        )
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
        elif isinstance(f, _Static) or (
            isinstance(f, Pending) and tuple(f.shape) == tuple(t.shape) and f.dtype == t.dtype
            if hasattr(t, "shape") and hasattr(t, "dtype")
            else type(f) is type(t)
        ):
            leaves.append(t if isinstance(f, _Static) else f)
            continue
        else:
            fix = "pass a template of the same model and configuration (shapes and dtypes)"
        raise TieError(
            f"load: the template (like=) does not match {path!r} at {where!r}: the file "
            f"has {_describe_leaf(f)}, the template has {_describe_leaf(t)}. Fix: {fix}."
        )
    return jtu.tree_unflatten(jtu.tree_structure(like), leaves)
