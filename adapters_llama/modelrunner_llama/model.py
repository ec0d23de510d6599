"""The Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) on modelrunner's layers.

Parameter names follow the Hugging Face checkpoints, except that ``q/k/v_proj`` are packed into
``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj`` (see ``packed_modules_mapping``), so each
layer runs two matmuls where transformers runs five. The family's differences are config switches:

- Qwen2: biases on ``q/k/v`` (not ``o``); Llama's ``attention_bias`` puts them on all four.
- Mistral: ``sliding_window`` on every layer; Qwen2: on the layers ``layer_types`` marks
  ``sliding_attention``. A window at least ``max_position`` long is dropped (it can never hide a key).
- ``tie_word_embeddings``: the LM head shares the embedding's parameter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from modelrunner.layers import (
    Attention,
    AttentionBackend,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    select_attention_backend,
)
from modelrunner.distributed import stage_layer_range
from modelrunner.parallel_state import ParallelState


def _tp(parallel: ParallelState) -> dict[str, Any]:
    return {"tp_rank": parallel.tp_rank, "tp_size": parallel.tp_size, "tp_group": parallel.tp_group}


def head_dim_of(config: Any) -> int:
    """``config.head_dim``, or ``hidden_size // num_attention_heads`` when the config has none."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_windows_of(config: Any, max_position: int) -> list[int | None]:
    """Each layer's sliding window (None: full causal attention)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    windows = []
    for i in range(config.num_hidden_layers):
        w = window if layer_types is None or layer_types[i] == "sliding_attention" else None
        windows.append(w if w is not None and w < max_position else None)
    return windows


class LlamaAttention(nn.Module):
    """Self-attention: fused qkv projection, RoPE, paged attention, output projection."""

    def __init__(self, config: Any, max_position: int, sliding_window: int | None, parallel: ParallelState,
                 backend: AttentionBackend) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        qwen2 = config.model_type == "qwen2"
        qkv_bias = True if qwen2 else bool(getattr(config, "attention_bias", False))
        o_bias = False if qwen2 else bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias, **_tp(parallel))
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=o_bias,
                                        **_tp(parallel))
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.rotary_emb = RotaryEmbedding.from_config(config, head_dim, max_position)
        self.attn = Attention(self.num_heads, head_dim, head_dim**-0.5, self.num_kv_heads, sliding_window, backend)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                metadata: Any) -> torch.Tensor:
        """``[tokens, hidden]`` → ``[tokens, hidden]``; stores the tokens' K/V in ``kv_cache``."""
        qkv = self.qkv_proj(hidden)
        tokens, heads, kv_heads, head_dim = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qk_width = (heads + kv_heads) * head_dim
        # q and k sit side by side in the fused output: rotate them in one go.
        qk = self.rotary_emb.rotate(positions, qkv[:, :qk_width].view(tokens, heads + kv_heads, head_dim))
        q, k = qk.split((heads, kv_heads), dim=1)
        v = qkv[:, qk_width:].view(tokens, kv_heads, head_dim)
        return self.o_proj(self.attn(q, k, v, kv_cache, metadata))


class LlamaMLP(nn.Module):
    """The gated MLP: ``down(silu(gate(x)) * up(x))`` with gate and up fused."""

    def __init__(self, config: Any, parallel: ParallelState) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported by the llama adapter (only 'silu')")
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=bias, **_tp(parallel))
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias, **_tp(parallel))
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[tokens, hidden]`` → ``[tokens, hidden]``."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``, the residual adds fused into the norms."""

    def __init__(self, config: Any, max_position: int, sliding_window: int | None, parallel: ParallelState,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, max_position, sliding_window, parallel, backend)
        self.mlp = LlamaMLP(config, parallel)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream)``; the next layer's input norm adds the two."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class StageMissingLayer(nn.Module):
    """Stands where a module of another pipeline stage would be, so layer indices and weight names
    still match the checkpoint; it holds no weights and refuses to be used."""

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"{name!r}: this module belongs to another pipeline stage (code walking "
                             "model.layers must skip StageMissingLayer)")

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, nn.Module):
            raise AttributeError(f"cannot set {name!r}: this module belongs to another pipeline stage")
        super().__setattr__(name, value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Always raises: the module runs on another pipeline stage."""
        raise RuntimeError("called a module that belongs to another pipeline stage")


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm — those of them on this pipeline stage."""

    def __init__(self, config: Any, max_position: int, parallel: ParallelState, backend: AttentionBackend) -> None:
        super().__init__()
        self.start_layer, self.end_layer = stage_layer_range(config.num_hidden_layers, parallel.pp_rank,
                                                             parallel.pp_size)
        """This stage's decoder layers are ``layers[start_layer:end_layer]``; the rest are placeholders."""
        # The last stage keeps a tied embedding: it is the LM head's weight.
        tied = bool(getattr(config, "tie_word_embeddings", False))
        has_embedding = parallel.is_first_stage or (tied and parallel.is_last_stage)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, **_tp(parallel))
                             if has_embedding else StageMissingLayer())
        windows = sliding_windows_of(config, max_position)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, max_position, windows[i], parallel, backend)
            if self.start_layer <= i < self.end_layer else StageMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if parallel.is_last_stage else StageMissingLayer()
        self.sliding_windows = tuple(sorted(set(windows), key=lambda w: -1 if w is None else w))
        """The distinct sliding windows of the layers (None = full attention)."""


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over a flattened, paged batch.

    :param config: the checkpoint's transformers config (Llama, Mistral or Qwen2).
    :param max_position: longest sequence the model will see (size of the RoPE table).
    :param parallel: this process's tensor-parallel rank; layers are built for its shard.
    :param attn_backend: the attention implementation (default: chosen for CPU).
    """

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    """Fused parameter → the checkpoint projections packed into it, in order."""

    def __init__(self, config: Any, max_position: int, parallel: ParallelState | None = None,
                 attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        parallel = parallel or ParallelState()
        self.config = config
        self.parallel = parallel
        """The tensor-parallel rank and pipeline stage the layers were built for."""
        self.attn_backend = attn_backend or select_attention_backend("cpu")
        """The attention implementation every layer uses; builds the per-step metadata."""
        self.model = LlamaModel(config, max_position, parallel, self.attn_backend)
        self.lm_head = (ParallelLMHead(config.vocab_size, config.hidden_size, **_tp(parallel))
                        if parallel.is_last_stage else StageMissingLayer())
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        """Whether the LM head shares the embedding's parameter."""
        if self.tie_word_embeddings and parallel.is_last_stage:
            self.lm_head.tie(self.model.embed_tokens)

    @property
    def ignored_weights(self) -> tuple[str, ...]:
        """Checkpoint name suffixes not loaded (RoPE tables; the LM head when tied)."""
        return ("rotary_emb.inv_freq",) + (("lm_head.weight",) if self.tie_word_embeddings else ())

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings ``[tokens, hidden]`` of token ids (what :meth:`forward` starts from)."""
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: Any,
                kv_caches: list[torch.Tensor], inputs_embeds: torch.Tensor | None = None,
                stage_inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
        """Final hidden states ``[tokens, hidden]`` of the batch's flattened tokens; on a pipeline
        stage other than the last, ``{"hidden_states", "residual"}`` for the next stage.

        :param batch: the step's :class:`~modelrunner.forward_batch.ForwardBatch` (for attention).
        :param kv_caches: one ``[2, num_blocks, block_size, kv_heads, head_dim]`` tensor per layer.
        :param inputs_embeds: ``[tokens, hidden]`` embeddings to start from instead of
            ``embed_input_ids(input_ids)`` (a multimodal model writes image features into them).
        :param stage_inputs: on a stage after the first, what the previous stage returned; when
            absent there (a dummy step, e.g. the runner's memory profile) the stage starts from zeros.
        """
        layers = self.model.layers[self.model.start_layer:self.model.end_layer]
        if len(kv_caches) != len(layers):
            raise ValueError(f"expected {len(layers)} KV-cache tensors (one per layer), got {len(kv_caches)}")
        metadata = self.attn_backend.build_metadata(batch, self.model.sliding_windows)
        if self.parallel.is_first_stage:
            hidden = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        elif stage_inputs is not None:
            hidden, residual = stage_inputs["hidden_states"], stage_inputs["residual"]
        else:
            weight = layers[0].input_layernorm.weight
            hidden = torch.zeros(input_ids.shape[0], self.config.hidden_size, dtype=weight.dtype, device=weight.device)
            residual = torch.zeros_like(hidden)
        for layer, kv_cache in zip(layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata)
        if not self.parallel.is_last_stage:
            return {"hidden_states": hidden, "residual": residual}
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits ``[rows, vocab_size]`` for final hidden states ``[rows, hidden]``."""
        return self.lm_head(hidden)
