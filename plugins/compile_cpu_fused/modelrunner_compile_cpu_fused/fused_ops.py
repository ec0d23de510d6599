"""Faster forwards bound onto the kernel's layers: the fused C++ CPU ops and the quantized gated MLP
in one call.

A decode step of a small model calls RMSNorm, rotary, ``silu(gate) * up`` and the KV-cache write
~100 times per token on a few hundred floats each; torch's versions are 5-8 operator calls apiece,
so their dispatch is what the step pays (SmolLM2-135M: RMSNorm 14.5 µs per call in torch, 6 µs
fused). :func:`bind_fused_ops` walks a model and, for each instance of a kernel layer whose method is
still the kernel's own (so subclasses that override it keep theirs), binds a version that calls the
ops built at install (:func:`modelrunner.layers.cpu_ops.ops`) where they apply — float32 CPU tensors
outside autograd and compilers (:func:`~modelrunner.layers.cpu_ops.fused`) — and the plain method
otherwise. The classes stay plain; only the instances of this model change.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from modelrunner.api import Attention, GatedMLP, RMSNorm, RotaryEmbedding, SiluAndMul, TorchSDPABackend, fused, ops
from torch import nn

from .unhooked import hooked, plain_type


def rms_norm(self: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
    """:meth:`RMSNorm.forward` through ``rms_norm`` / ``add_rms_norm``."""
    ops = fused(x, bf16=True)
    weight = self.weight
    if ops is not None and weight.dtype is x.dtype and x.is_contiguous():
        if residual is None:
            return ops.rms_norm(x, weight, self.eps)
        if residual.dtype is x.dtype and residual.is_contiguous() and residual.shape == x.shape:
            return ops.add_rms_norm(x, residual, weight, self.eps)
    return RMSNorm.forward(self, x, residual)


def silu_and_mul(self: SiluAndMul, x: torch.Tensor) -> torch.Tensor:
    """:meth:`SiluAndMul.forward` through ``silu_and_mul``."""
    ops = fused(x, bf16=True)
    return ops.silu_and_mul(x) if ops is not None else SiluAndMul.forward(self, x)


def rotate(self: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """:meth:`RotaryEmbedding.rotate` through ``rotary`` (which reads a strided q/k view in place)."""
    ops = fused(x, bf16=True)
    if (ops is not None and self.cos_sin_cache.dtype is x.dtype and x.dim() == 3 and x.stride(-1) == 1
            and positions.dtype is torch.int64):
        return ops.rotary(positions, x, self.cos_sin_cache)
    return RotaryEmbedding.rotate(self, positions, x)


def write_kv(self: TorchSDPABackend, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor) -> None:
    """:meth:`TorchSDPABackend.write_kv` through ``store_kv``."""
    ops = fused(key, bf16=True)
    if (ops is not None and kv_cache.is_contiguous() and slot_mapping.dtype is torch.int64
            and key.dtype is kv_cache.dtype and value.dtype is kv_cache.dtype):
        ops.store_kv(kv_cache, slot_mapping, key, value)
        return
    TorchSDPABackend.write_kv(self, kv_cache, slot_mapping, key, value)


def gated_mlp_fusable(mlp: GatedMLP) -> bool:
    """Whether ``mlp``'s quantization scheme may compute it in one call: both projections quantized,
    the scheme offers ``gated_mlp``, the kernel's ``SiluAndMul``, one tensor-parallel rank, no biases."""
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    scheme = getattr(gate_up, "quant_scheme", None)
    return (scheme is not None and getattr(down, "quant_scheme", None) is not None and hasattr(scheme, "gated_mlp")
            and plain_type(mlp.act_fn) is SiluAndMul and down.tp_size == 1 and gate_up.tp_size == 1
            and gate_up.bias is None and down.bias is None)


def gated_mlp_call(mlp: GatedMLP, x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The quantization scheme's one-call form of a fusable ``mlp`` for ``x``
    (:meth:`~modelrunner_quantization.planar.PlanarScheme.gated_mlp`), or None: only for a 2-D
    contiguous float32 ``x`` outside compilers, and no forward hooks on the three parts (they would
    not run)."""
    if x.dtype is not torch.float32 or x.dim() != 2 or not x.is_contiguous() or torch.compiler.is_compiling():
        return None
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    if hooked(gate_up, mlp.act_fn, down):
        return None
    return gate_up.quant_scheme.gated_mlp(gate_up, down)


def gated_mlp(self: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    """:meth:`GatedMLP.forward` as one quantized kernel call where :func:`gated_mlp_call` gives one."""
    one_call = gated_mlp_call(self, x)
    return one_call(x) if one_call is not None else GatedMLP.forward(self, x)


def _bind(obj: Any, name: str, plain: Callable[..., Any], fast: Callable[..., Any]) -> bool:
    """Bind ``fast`` as ``obj.<name>`` where ``obj``'s class still has the kernel's ``plain`` method."""
    if getattr(type(obj), name, None) is not plain or name in vars(obj):
        return False
    setattr(obj, name, types.MethodType(fast, obj))
    return True


def bind_fused_ops(model: nn.Module) -> dict[str, int]:
    """Bind the fused forwards onto ``model``'s layers: the C++ ops where they were built (none
    where :func:`~modelrunner.layers.cpu_ops.ops` is None), the one-call gated MLP where the
    quantization scheme offers it. Returns ``{"RMSNorm": count, ...}`` of what was bound."""
    counts: dict[str, int] = {}

    def bound(what: str, done: bool) -> None:
        if done:
            counts[what] = counts.get(what, 0) + 1

    native = ops() is not None
    for module in model.modules():
        if isinstance(module, GatedMLP) and gated_mlp_fusable(module):
            bound("GatedMLP", _bind(module, "forward", GatedMLP.forward, gated_mlp))
        if not native:
            continue
        if isinstance(module, RMSNorm):
            bound("RMSNorm", _bind(module, "forward", RMSNorm.forward, rms_norm))
        elif isinstance(module, SiluAndMul):
            bound("SiluAndMul", _bind(module, "forward", SiluAndMul.forward, silu_and_mul))
        elif isinstance(module, RotaryEmbedding):
            bound("RotaryEmbedding", _bind(module, "rotate", RotaryEmbedding.rotate, rotate))
        elif isinstance(module, Attention) and isinstance(module.backend, TorchSDPABackend):
            bound("write_kv", _bind(module.backend, "write_kv", TorchSDPABackend.write_kv, write_kv))
    return counts


__all__ = ["bind_fused_ops", "gated_mlp", "gated_mlp_call", "gated_mlp_fusable", "rms_norm", "rotate",
           "silu_and_mul", "write_kv"]
