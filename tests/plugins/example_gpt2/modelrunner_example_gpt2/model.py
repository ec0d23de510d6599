"""GPT-2 built from modelrunner's layers; module names follow the checkpoint's tensor names."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from modelrunner.layers import Attention, AttentionBackend, ParallelLMHead, ReplicatedLinear, VocabParallelEmbedding


def conv1d(in_features: int, out_features: int) -> ReplicatedLinear:
    """A linear layer for a GPT-2 ``Conv1D`` tensor, which the checkpoint stores transposed (``[in, out]``)."""
    layer = ReplicatedLinear(in_features, out_features, bias=True)
    load = layer.weight.weight_loader
    layer.weight.weight_loader = lambda param, weight, shard_id=None: load(param, weight.t(), shard_id)
    return layer


class GPT2Attention(nn.Module):
    """Fused q/k/v projection, paged attention over the layer's KV cache, output projection."""

    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        super().__init__()
        self.heads, self.head_dim = config.n_head, config.n_embd // config.n_head
        self.c_attn = conv1d(config.n_embd, 3 * config.n_embd)
        self.c_proj = conv1d(config.n_embd, config.n_embd)
        self.paged = Attention(self.heads, self.head_dim, self.head_dim**-0.5, backend=backend)

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, metadata: Any) -> torch.Tensor:
        """``[tokens, hidden]`` → ``[tokens, hidden]``; writes the tokens' K/V into ``kv_cache``."""
        q, k, v = self.c_attn(x).view(-1, 3, self.heads, self.head_dim).unbind(1)
        return self.c_proj(self.paged(q, k, v, kv_cache, metadata))


class GPT2Block(nn.Module):
    """Pre-LayerNorm block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))`` with a gelu_new MLP."""

    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        super().__init__()
        hidden, inner = config.n_embd, config.n_inner or 4 * config.n_embd
        self.ln_1 = nn.LayerNorm(hidden, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config, backend)
        self.ln_2 = nn.LayerNorm(hidden, eps=config.layer_norm_epsilon)
        self.mlp = nn.ModuleDict({"c_fc": conv1d(hidden, inner), "c_proj": conv1d(inner, hidden)})

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, metadata: Any) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, metadata)
        mlp = self.mlp
        return x + mlp["c_proj"](F.gelu(mlp["c_fc"](self.ln_2(x)), approximate="tanh"))  # gelu_new


class GPT2LMHeadModel(nn.Module):
    """GPT-2 over a flattened, paged batch: token + learned position embeddings, blocks, tied LM head."""

    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        super().__init__()
        if config.activation_function != "gelu_new" or config.scale_attn_by_inverse_layer_idx:
            raise ValueError("example_gpt2 supports activation_function='gelu_new' without "
                             "scale_attn_by_inverse_layer_idx only")
        self.backend = backend
        self.transformer = nn.ModuleDict({
            "wte": VocabParallelEmbedding(config.vocab_size, config.n_embd),
            "wpe": nn.Embedding(config.n_positions, config.n_embd),
            "h": nn.ModuleList(GPT2Block(config, backend) for _ in range(config.n_layer)),
            "ln_f": nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon),
        })
        self.lm_head = ParallelLMHead(config.vocab_size, config.n_embd)
        self.lm_head.tie(self.transformer["wte"])  # GPT-2 always ties; the checkpoint has no lm_head

    def forward(self, batch: Any, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Final hidden states ``[tokens, hidden]``; ``kv_caches`` holds one tensor per block."""
        metadata = self.backend.build_metadata(batch)  # once per step, shared by every layer
        t = self.transformer
        x = t["wte"](batch.input_ids) + t["wpe"](batch.positions)
        for block, kv_cache in zip(t["h"], kv_caches):
            x = block(x, kv_cache, metadata)
        return t["ln_f"](x)
