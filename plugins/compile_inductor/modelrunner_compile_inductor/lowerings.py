"""Inductor lowerings for the kernel's two custom ops, so compiled graphs call no Python per layer.

Left to inductor's defaults, both ops are *fallback kernels*: the generated wrapper calls them
through torch's Python custom-op machinery, once per linear layer and cache write (150 calls per
SmolLM2 decode step; the plugin's README has the measured cost). Lowered:

- ``modelrunner::onednn_linear`` becomes oneDNN's linear called directly (the extern kernel
  inductor itself uses for frozen weights, here on the live, unpacked weight);
- ``modelrunner::store_kv`` becomes two in-place scatters into the cache, which inductor fuses
  with the neighbouring pointwise kernels. (Traced as ``index_copy_`` instead, the write would be
  functionalized into a copy of the whole cache per layer; the custom op exists to prevent that.)

Both use inductor internals (``register_lowering``, ``LinearUnary``); :func:`install` returns False
and leaves the fallbacks in place where this torch lacks them.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def install() -> bool:
    """Register the lowerings once per process; whether they are in place."""
    try:
        from torch._inductor.ir import TensorBox
        from torch._inductor.lowering import lowerings, register_lowering
        from torch._inductor.mkldnn_ir import LinearUnary

        import modelrunner.api  # noqa: F401 - defines the modelrunner::onednn_linear and store_kv ops

        linear_op, store_op = torch.ops.modelrunner.onednn_linear.default, torch.ops.modelrunner.store_kv.default
    except (ImportError, AttributeError):
        return False
    aten = torch.ops.aten

    @register_lowering(linear_op, type_promotion_kind=None)
    def _onednn_linear(x, weight, bias):  # noqa: ANN001, ANN202  (inductor IR values)
        return TensorBox.create(LinearUnary.create(x, weight, bias, "none", [], ""))

    @register_lowering(store_op, type_promotion_kind=None)
    def _store_kv(kv_cache, slot_mapping, key, value):  # noqa: ANN001, ANN202
        # kv_cache is [2, blocks, block_size, kv_heads, head_dim]: slot s is block s // block_size, row s % block_size.
        block_size = kv_cache.get_size()[2]
        block = lowerings[aten.div.Tensor_mode](slot_mapping, block_size, rounding_mode="floor")
        row = lowerings[aten.remainder.Scalar](slot_mapping, block_size)
        keys_half = lowerings[aten.mul](slot_mapping, 0)
        values_half = lowerings[aten.add](keys_half, 1)
        lowerings[aten.index_put_](kv_cache, [keys_half, block, row], key)
        lowerings[aten.index_put_](kv_cache, [values_half, block, row], value)

    return True
