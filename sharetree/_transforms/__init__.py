"""Transforms: hashable, value-equal, picklable functions from a buffer to a view.

``protocol`` holds the base class, the registry of spec names and the chain normal form
(with ``identity``, its unit); ``builtins`` the built-in transforms of whole arrays, ``views``
those of part of a buffer (``slice``, ``index``, ``take``), ``combine`` those of several
values (``lora``, ``add``, ``matmul``), ``quant`` those of tables quantized in MLX's affine
layout (``dequantize``, ``fake_quant``; ``quantize`` makes such a table); ``spec`` the
reading of (untrusted) JSON specs and the stand-ins that describe a file's transforms.
docs/ties_and_transforms.md describes each transform and how to write your own.
"""

from sharetree._transforms.builtins import (
    T,
    astype,
    fn,
    reshape,
    scale,
    transpose,
)
from sharetree._transforms.combine import add, lora, matmul
from sharetree._transforms.protocol import (
    ANY_NAMES,
    REGISTRY,
    Names,
    Transform,
    canonical_dtype,
    chain,
    check_inputs,
    check_transform,
    identity,
    input_names,
    is_factory,
    is_int,
    is_real,
    parts_of,
    view_axis_names,
)
from sharetree._transforms.quant import Quantized, dequantize, fake_quant, quantize
from sharetree._transforms.spec import (
    describe_several,
    describe_spec,
    describe_transform,
    is_described,
    transform_from_spec,
)
from sharetree._transforms.views import index, slice, take

# Pickles written before the split (sharetree/_transforms.py) name the built-in classes
# here, as sharetree._transforms._Scale and so on: each old name stays bound to its class,
# looked up by its registered spec name (the classes stay private to their modules).
_Transpose, _Reshape, _AsType, _Scale, _Fn = (
    REGISTRY[n] for n in ("transpose", "reshape", "astype", "scale", "fn")
)
_Slice, _Index, _Chain, _Identity = (REGISTRY[n] for n in ("slice", "index", "chain", "identity"))

__all__ = [
    "ANY_NAMES",
    "REGISTRY",
    "Names",
    "Quantized",
    "T",
    "Transform",
    "add",
    "astype",
    "canonical_dtype",
    "chain",
    "check_inputs",
    "check_transform",
    "describe_several",
    "describe_spec",
    "describe_transform",
    "dequantize",
    "fake_quant",
    "fn",
    "identity",
    "index",
    "input_names",
    "is_described",
    "is_factory",
    "is_int",
    "is_real",
    "lora",
    "matmul",
    "parts_of",
    "quantize",
    "reshape",
    "scale",
    "slice",
    "take",
    "transform_from_spec",
    "transpose",
    "view_axis_names",
]
