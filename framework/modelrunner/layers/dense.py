"""``x Wᵀ + b`` through the fastest matmul torch has for the device and dtype, optionally on weights
prepacked once into oneDNN's blocked layout.

On x86 CPUs torch's ``F.linear`` calls MKL's sgemm; oneDNN's matmul, on the same unpacked weight,
is often faster for the shapes of LLM layers (``bench/moe_layer.py`` and the README have the
numbers). Every linear layer of the kernel goes through :func:`dense`, so adapters get the faster
path for free.

Prepacking (:func:`prepack_weights`, which the ``eager`` compile backend applies) reorders each
weight once into the layout oneDNN's kernels read, instead of at every call (used from
:data:`PACKED_MIN_ROWS` rows up), for one extra copy of the packed weights' memory. A module opts in
by listing its weight parameters in a ``DENSE_WEIGHTS`` class attribute and passing them to
:func:`dense` (2-D) or :func:`dense` with ``packed=packed_weight(param)[i]`` (a 3-D stack of
matrices, e.g. MoE experts).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

PACKED_MIN_ROWS = 4
"""Fewest rows that use a packed weight (below it the plain weight measured as fast or faster)."""

PACKED_ATTR = "onednn_packed"
"""Attribute of a weight parameter holding its oneDNN-packed copy (a list of them for a 3-D stack)."""


@functools.cache
def onednn_usable() -> bool:
    """Whether this torch build has oneDNN's fused linear op and its weight reorder."""
    try:
        return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
    except (AttributeError, RuntimeError):
        return False


@torch.library.custom_op("modelrunner::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's float32 linear on an unpacked weight, opaque to compilers (inductor's own lowering of
    the op accepts only frozen, constant weights)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


_onednn_in_graphs = False


@contextlib.contextmanager
def onednn_in_compiled_graphs(enabled: bool = True) -> Iterator[None]:
    """While tracing under this context, :func:`dense` puts oneDNN's linear (:func:`onednn_linear`,
    which inductor calls as an external kernel) into the graph instead of ``F.linear`` (which
    inductor lowers to MKL's sgemm, slower on the reference CPU).

    Meant for graphs whose weights inductor does not freeze (freezing prepacks ``F.linear``'s
    weights itself). Dynamo guards on the setting, so a graph traced with it is reused only with it.
    """
    global _onednn_in_graphs
    previous, _onednn_in_graphs = _onednn_in_graphs, enabled and onednn_usable()
    try:
        yield
    finally:
        _onednn_in_graphs = previous


def _onednn_applies(x: torch.Tensor) -> bool:
    return (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.shape[0] > 0
            and onednn_usable())


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
          packed: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` of shape ``[rows, in]``.

    :param packed: ``weight`` prepacked for oneDNN (default: the copy :func:`prepack_weights`
        attached to ``weight``, if any). Used only where the oneDNN path applies, from
        :data:`PACKED_MIN_ROWS` rows up.
    """
    if torch.compiler.is_compiling():
        # Compilers get the plain linear (inductor picks, and with freezing prepacks, its own
        # matmul) unless a backend asked for oneDNN's op in its graphs.
        if _onednn_in_graphs and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2:
            return onednn_linear(x, weight, bias)
        return F.linear(x, weight, bias)
    if _onednn_applies(x):
        if x.shape[0] < PACKED_MIN_ROWS:
            packed = None
        elif packed is None:
            packed = getattr(weight, PACKED_ATTR, None)
        return torch.ops.mkldnn._linear_pointwise(x, weight if packed is None else packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def packed_weight(weight: torch.Tensor) -> Any:
    """The packed copy :func:`prepack_weights` attached to ``weight`` (a list for a 3-D stack), or None."""
    return getattr(weight, PACKED_ATTR, None)


def prepack_weights(model: nn.Module) -> int:
    """Attach a oneDNN-packed copy to every weight a module lists in ``DENSE_WEIGHTS``.

    Only float32 CPU weights are packed (elsewhere :func:`dense` does not use oneDNN). The dense
    parameters stay as they are: weight loaders, tied embeddings, state dicts and compilers keep
    working on them. Packing again replaces the copies (call it after editing weights in place).

    :returns: bytes the packed copies take.
    """
    if not onednn_usable():
        return 0
    total = 0
    seen: set[int] = set()
    with torch.no_grad():
        for module in model.modules():
            for name in getattr(module, "DENSE_WEIGHTS", ()):
                weight = getattr(module, name, None)
                if (not isinstance(weight, torch.Tensor) or id(weight) in seen or weight.dtype != torch.float32
                        or weight.device.type != "cpu" or weight.dim() not in (2, 3) or weight.is_meta):
                    continue
                seen.add(id(weight))
                if weight.dim() == 2:
                    packed: Any = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
                else:
                    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weight.detach()]
                setattr(weight, PACKED_ATTR, packed)
                total += weight.numel() * weight.element_size()
    return total


def unpack_weights(model: nn.Module) -> None:
    """Drop the packed copies :func:`prepack_weights` attached (their memory is freed)."""
    for param in model.parameters():
        if hasattr(param, PACKED_ATTR):
            delattr(param, PACKED_ATTR)
