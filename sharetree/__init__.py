"""sharetree: explicit parameter sharing (tied weights) in JAX pytrees (a tour: README.md)."""

from sharetree._adapters import add_lora, merge_lora
from sharetree._blocks import share_blocks
from sharetree._detect import find_ties, tie_identical
from sharetree._display import summary
from sharetree._errors import TieError, TieTypeError
from sharetree._files.format import LIBRARY_VERSION as __version__  # noqa: F401 (not in __all__)
from sharetree._files.load import load
from sharetree._files.mlx_save import save_mlx
from sharetree._files.peft import load_adapter
from sharetree._files.peft_save import save_adapter
from sharetree._files.save import save
from sharetree._flat import Restructure, destructure
from sharetree._grad_by_use import grad_by_use
from sharetree._grad_report import GradReport, grad_report
from sharetree._labels import Partition, combine, label_by_path, mask_by_path, partition
from sharetree._materialize import materialize
from sharetree._report import Buffer, SharingGraph, View, ViewInput, canonicalize
from sharetree._sharding import shardings_by_path
from sharetree._tie import tie
from sharetree._tied import Tied
from sharetree._transforms import (
    ANY_NAMES,
    Quantized,
    T,
    Transform,
    add,
    astype,
    chain,
    dequantize,
    fake_quant,
    fn,
    identity,
    index,
    lora,
    matmul,
    quantize,
    reshape,
    scale,
    slice,
    take,
    transform_from_spec,
    transpose,
)
from sharetree._treescope import MaterializedDisplay, treescope_materialized
from sharetree._untie import untie, untie_state

__all__ = [
    "ANY_NAMES",
    "Buffer",
    "GradReport",
    "MaterializedDisplay",
    "Quantized",
    "Restructure",
    "SharingGraph",
    "T",
    "TieError",
    "TieTypeError",
    "Tied",
    "Transform",
    "View",
    "ViewInput",
    "add",
    "add_lora",
    "astype",
    "canonicalize",
    "chain",
    "dequantize",
    "destructure",
    "fake_quant",
    "find_ties",
    "fn",
    "grad_by_use",
    "grad_report",
    "identity",
    "index",
    "label_by_path",
    "load_adapter",
    "load",
    "lora",
    "mask_by_path",
    "materialize",
    "matmul",
    "merge_lora",
    "quantize",
    "reshape",
    "save",
    "save_mlx",
    "save_adapter",
    "partition",
    "combine",
    "Partition",
    "scale",
    "share_blocks",
    "shardings_by_path",
    "slice",
    "summary",
    "take",
    "tie",
    "tie_identical",
    "transform_from_spec",
    "transpose",
    "treescope_materialized",
    "untie",
    "untie_state",
]
