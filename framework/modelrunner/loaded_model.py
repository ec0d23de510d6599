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
    """The adapter's module (the forward hook recognises its own by type)."""
    tokenizer: Any
    """A transformers tokenizer for the checkpoint."""
    hf_config: Any
    """The checkpoint's transformers config."""
    kv_cache_spec: KVCacheSpec | None
    """Shape of the paged KV cache the model reads and writes; None when the model keeps its own
    cache (then prefix caching is off and the kernel allocates no KV tensors)."""
    adapter: str = "?"
    """Name of the plugin that loaded it (shown by the CLI and in errors)."""
    runnable: Callable[..., Any] | None = None
    """The callable the forward hook runs: ``model`` itself or what the compile hook returned."""
    extra: dict[str, Any] = attrs.field(factory=dict)
    """Adapter-owned state (e.g. per-sequence caches of the generic transformers adapter)."""

    @property
    def vocab_size(self) -> int:
        """Rows of the logits the model produces."""
        cfg = getattr(self.hf_config, "get_text_config", lambda: self.hf_config)()
        return int(cfg.vocab_size)
