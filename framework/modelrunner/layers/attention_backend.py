"""The seam where paged-attention implementations plug in.

An :class:`AttentionBackend` does two things: once per step, turn the :class:`ForwardBatch` into
whatever per-step tensors it needs (``build_metadata``); then, per layer, write the new keys/values
into the layer's paged cache at ``batch.slot_mapping`` and attend each sequence's queries to its
cached keys through its block table (``forward``). Plugins declare backends with
``registry.attention_backends(cls)``; the runner picks one per model (config field
``attention_backend``, else the highest-priority one that supports the device) and hands it to the
adapter's load hook, so a GPU kernel (flash-attn, FlashInfer) plugs in without touching models.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from ..forward_batch import ForwardBatch


class AttentionLayer(Protocol):
    """What a backend reads from the layer it attends for: the layer's shape on this rank.

    :class:`~.attention.Attention` is one; the backend depends on this, not on the layer's module.
    """

    num_heads: int
    """Query heads on this rank."""
    num_kv_heads: int
    """Key/value heads on this rank."""
    head_dim: int
    """Size of each head."""
    scale: float
    """Multiplier of ``QKᵀ``."""
    sliding_window: int | None
    """Window of visible past positions (None: full causal attention)."""


class GraphInputs(NamedTuple):
    """How a step's attention metadata enters a replayed decode graph
    (:meth:`AttentionBackend.graph_inputs`).

    A graph is recorded once per ``key`` and replayed for every later step with the same key: only
    ``tensors`` change between those steps; everything else the backend reads from the metadata
    while attending must be the same for every step with that key.
    """

    key: Any
    """Hashable; equal for steps whose metadata differ only in the values of ``tensors``."""
    tensors: tuple[torch.Tensor, ...]
    """The metadata's per-step tensors (slot mapping, block table, sequence lengths …)."""
    rebuild: Callable[..., Any]
    """``rebuild(*tensors)`` → metadata this backend attends with, made from those tensors."""


class AttentionBackend(abc.ABC):
    """One implementation of paged attention (the seam where faster kernels plug in)."""

    name: ClassVar[str] = "?"
    """Registry name (``torch_sdpa``, ``flash_attn``, ...)."""
    priority: ClassVar[int] = 0
    """Higher wins when several backends support the device."""

    max_block_size: ClassVar[int | None] = None
    """Largest KV-cache ``block_size`` the backend serves (None: any)."""
    supports_sliding_window: ClassVar[bool] = True
    """Whether layers with a ``sliding_window`` can use the backend."""
    dtypes: ClassVar[tuple[torch.dtype, ...] | None] = None
    """Cache dtypes the backend serves (None: any floating-point dtype)."""

    @classmethod
    def supports(cls, device: torch.device) -> bool:
        """Whether this backend can run on ``device`` (e.g. a CUDA kernel returns False on CPU)."""
        return True

    @classmethod
    def check_config(cls, block_size: int, dtype: torch.dtype | None = None) -> None:
        """Refuse, before anything loads, a cache layout the backend cannot serve.

        :raises ValueError: naming the backend, the bad value and what it accepts.
        """
        if cls.max_block_size is not None and block_size > cls.max_block_size:
            raise ValueError(f"attention backend {cls.name!r} serves block_size up to {cls.max_block_size}, "
                             f"got block_size={block_size}; lower block_size or choose another attention_backend")
        if dtype is not None and cls.dtypes is not None and dtype not in cls.dtypes:
            accepted = ", ".join(str(d).removeprefix("torch.") for d in cls.dtypes)
            raise ValueError(f"attention backend {cls.name!r} serves dtypes {accepted}, got "
                             f"{str(dtype).removeprefix('torch.')}; choose another dtype or attention_backend")

    @classmethod
    def check_model(cls, sliding_windows: Iterable[int | None]) -> None:
        """Refuse a model whose layers need what the backend lacks (called once the model is built).

        :raises ValueError: naming the backend and the unsupported feature.
        """
        windows = sorted({w for w in sliding_windows if w is not None})
        if windows and not cls.supports_sliding_window:
            raise ValueError(f"attention backend {cls.name!r} does not support sliding-window attention, which "
                             f"this model's layers use (window {windows[0]}); choose another attention_backend")

    @abc.abstractmethod
    def build_metadata(self, batch: ForwardBatch, sliding_windows: Iterable[int | None] = (None,)) -> Any:
        """Per-step tensors shared by every attention layer of the model (built once per forward).

        :param batch: the step's flattened batch.
        :param sliding_windows: the distinct ``sliding_window`` values of the model's layers.
        """

    def graph_inputs(self, metadata: Any) -> GraphInputs | None:
        """How decode steps with this ``metadata`` may be replayed as a recorded graph (see
        the ``cpu_fused`` compile backend's decode graphs), or None (the default): they run eagerly. A backend
        returns a :class:`GraphInputs` only where its ``forward`` reads nothing from the metadata but
        those tensors and what the key fixes."""
        return None

    @abc.abstractmethod
    def forward(
        self,
        layer: AttentionLayer,
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
