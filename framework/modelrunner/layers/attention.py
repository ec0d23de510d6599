"""Paged attention over a flattened variable-length batch, behind a small backend seam.

An :class:`AttentionBackend` does two things: once per step, turn the :class:`ForwardBatch` into
whatever per-step tensors it needs (``build_metadata``); then, per layer, write the new keys/values
into the layer's paged cache at ``batch.slot_mapping`` and attend each sequence's queries to its
cached keys through its block table (``forward``). Backends register by name with
:func:`register_attention_backend`; :func:`select_attention_backend` picks the highest-priority one
that supports the device, so a GPU kernel (flash-attn, FlashInfer) plugs in without touching models.

The built-in ``torch_sdpa`` backend (:mod:`.sdpa_attention`) runs everywhere torch does.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from ..forward_batch import ForwardBatch


class AttentionBackend(abc.ABC):
    """One implementation of paged attention (the seam where faster kernels plug in)."""

    name: ClassVar[str] = "?"
    """Registry name (``torch_sdpa``, ``flash_attn``, ...)."""
    priority: ClassVar[int] = 0
    """Higher wins when several backends support the device."""

    @classmethod
    def supports(cls, device: torch.device) -> bool:
        """Whether this backend can run on ``device`` (e.g. a CUDA kernel returns False on CPU)."""
        return True

    @abc.abstractmethod
    def build_metadata(self, batch: ForwardBatch, sliding_windows: Iterable[int | None] = (None,)) -> Any:
        """Per-step tensors shared by every attention layer of the model (built once per forward).

        :param batch: the step's flattened batch.
        :param sliding_windows: the distinct ``sliding_window`` values of the model's layers.
        """

    @abc.abstractmethod
    def forward(
        self,
        layer: Attention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
    ) -> torch.Tensor:
        """Store ``key``/``value`` in ``kv_cache`` and attend.

        :param layer: the calling layer (heads, scale, sliding window).
        :param query: ``[tokens, num_heads, head_dim]``.
        :param key: ``[tokens, num_kv_heads, head_dim]``; ``value`` likewise.
        :param kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
        :param metadata: what :meth:`build_metadata` returned for this step.
        :returns: ``[tokens, num_heads * head_dim]``.
        """


_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_attention_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Class decorator: make an :class:`AttentionBackend` selectable under ``cls.name``."""
    _BACKENDS[cls.name] = cls
    return cls


def attention_backends(device: torch.device | str | None = None) -> list[str]:
    """Names of the registered attention backends; with ``device``, only those that support it."""
    _load_builtin()
    if device is None:
        return sorted(_BACKENDS)
    return sorted(name for name, cls in _BACKENDS.items() if cls.supports(torch.device(device)))


def select_attention_backend(device: torch.device | str = "cpu", name: str | None = None) -> AttentionBackend:
    """An instance of backend ``name``, or of the highest-priority backend that supports ``device``.

    :raises ValueError: ``name`` is unknown (the message lists the registered ones) or does not
        support ``device``.
    """
    _load_builtin()
    device = torch.device(device)
    if name is not None:
        if name not in _BACKENDS:
            raise ValueError(f"unknown attention backend {name!r}; registered: {', '.join(sorted(_BACKENDS))}")
        if not _BACKENDS[name].supports(device):
            raise ValueError(f"attention backend {name!r} does not support device {device}")
        return _BACKENDS[name]()
    usable = [b for b in _BACKENDS.values() if b.supports(device)]
    return max(usable, key=lambda b: b.priority)()


def _load_builtin() -> None:
    from . import sdpa_attention  # noqa: F401  (registers torch_sdpa)


class Attention(nn.Module):
    """The attention core of one layer: cache write, paged read, softmax(QKᵀ)V. No projections.

    :param num_heads: query heads on this rank.
    :param head_dim: size of each head.
    :param scale: multiplier of ``QKᵀ`` (usually ``head_dim ** -0.5``).
    :param num_kv_heads: key/value heads on this rank (fewer than ``num_heads`` for GQA).
    :param sliding_window: attend only to the last ``sliding_window`` positions (Mistral); None: all.
    :param backend: the implementation; default: :func:`select_attention_backend` for CPU.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int | None = None,
        sliding_window: int | None = None,
        backend: AttentionBackend | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        """Query heads on this rank."""
        self.num_kv_heads = num_kv_heads
        """Key/value heads on this rank."""
        self.head_dim = head_dim
        """Size of each head."""
        self.scale = scale
        """Multiplier of the attention scores."""
        self.sliding_window = sliding_window
        """Window of visible past positions, or None for full causal attention."""
        self.backend = backend or select_attention_backend("cpu")
        """The attention implementation."""

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, metadata: Any
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`."""
        return self.backend.forward(self, query, key, value, kv_cache, metadata)

    def extra_repr(self) -> str:
        window = f", sliding_window={self.sliding_window}" if self.sliding_window else ""
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}{window}, "
                f"backend={self.backend.name}")
