"""MLX's quantized checkpoints, both ways: the tree of a directory ``mlx_lm`` wrote, ``save_mlx``.

MLX's layout (``mlx_lm.convert``, ``mlx_lm.utils.save_model`` / ``save_config``): a
quantized layer ``<name>`` is three tensors, ``<name>.weight`` (uint32, the packed values),
``<name>.scales`` and ``<name>.biases`` (see :func:`sharetree.dequantize`); a linear
layer's own ``<name>.bias`` sits beside them. ``config.json`` holds ``"quantization":
{"group_size", "bits", "mode"}`` (``mlx_lm`` writes the same dict as
``"quantization_config"`` too), where a layer quantized otherwise has an entry of its own
(``"<name>": {"group_size", "bits"}``, or ``false``: not quantized), and
``tie_word_embeddings``: the head is the embedding (``QuantizedEmbedding.as_linear``), and
the file holds no head tensor.

The tree (:func:`mlx_tree`) is the flat dict of the file's tensors with each quantized
layer's triple under ``<name>`` as ``{"q", "scales", "biases"}`` (what
:func:`sharetree.quantize` returns) and its float weight ``<name>.weight`` a
``dequantize`` view of it; a tied head ``lm_head.weight`` is the same view of the
embedding's triple. :func:`save_mlx` writes such a tree back in MLX's layout.
"""

from sharetree._mlx.config import (
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    MlxConfig,
    Quant,
    read_config,
)
from sharetree._mlx.load import MlxTree, mlx_tree
from sharetree._mlx.save import save_mlx

__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "SINGLE_FILE",
    "MlxConfig",
    "MlxTree",
    "Quant",
    "mlx_tree",
    "read_config",
    "save_mlx",
]
