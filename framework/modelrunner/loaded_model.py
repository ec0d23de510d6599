"""What a load hook returns: the model and everything the runner needs to drive it."""

from __future__ import annotations

from typing import Any, Callable

import attrs
import torch

from .kv_cache.spec import KVCacheSpec


@attrs.define
class LoadedModel:
    """A model loaded by an adapter, as the runner holds it."""

    model: torch.nn.Module
    """The adapter's module."""
    tokenizer: Any
    """A transformers tokenizer for the checkpoint."""
    hf_config: Any
    """The checkpoint's transformers config."""
    kv_cache_spec: KVCacheSpec | None
    """Shape of the paged KV cache the model reads and writes; None when the model keeps its own
    cache (then prefix caching is off and the kernel allocates no KV tensors)."""
    adapter: str = "?"
    """Name of the plugin that loaded it; set by the kernel, which routes the ``forward``,
    ``parallelize`` and ``process_inputs`` hooks of this model to that plugin only."""
    runnable: Callable[..., Any] | None = None
    """The callable the forward hook runs: ``model`` itself or what the compile hook returned."""
    extra: dict[str, Any] = attrs.field(factory=dict)
    """Adapter-owned state (e.g. per-sequence caches of the generic transformers adapter)."""
    causal: bool = True
    """Whether each token attends to earlier ones only (a decoder). False for an encoder (bidirectional
    attention, e.g. BERT): the engine then computes a prompt in one step, never in chunks, and the
    model serves embeddings only."""
    parts: dict[str, LoadedModel] = attrs.field(factory=dict)
    """Sub-models loaded through ``loader.load`` (e.g. a LLaVA model's ``language_model``); the
    kernel parallelizes each through the plugin that loaded it before the model itself."""

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokenizer's EOS plus every ``eos_token_id`` of the model config (which may be a list)."""
        ids: set[int] = set()
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        text = getattr(self.hf_config, "get_text_config", lambda: self.hf_config)()
        eos = getattr(text, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(t) for t in eos)
        return frozenset(ids)

    @property
    def vocab_size(self) -> int:
        """Rows of the logits the model produces."""
        cfg = getattr(self.hf_config, "get_text_config", lambda: self.hf_config)()
        return int(cfg.vocab_size)
