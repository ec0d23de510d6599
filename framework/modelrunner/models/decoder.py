"""The pre-norm decoder most causal LMs share (Llama, Mistral, Qwen2, their MoE relatives), built from
the kernel's layers so adapters extend it instead of copying it (vLLM keeps the same in ``llama.py``).

A :class:`DecoderForCausalLM` is an embedding, decoder layers of attention (fused q/k/v projection,
RoPE, paged attention, output projection) and MLP, a final RMSNorm and an LM head. Subclasses change
a part by overriding one factory: :meth:`DecoderForCausalLM.make_attention` /
:meth:`~DecoderForCausalLM.make_mlp` per layer, :meth:`~DecoderForCausalLM.attention_biases` for
the projections' biases. Parameter names follow Hugging Face checkpoints, except that
``q/k/v_proj`` are packed into ``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj``
(``packed_modules_mapping``).

Tensor parallelism is applied while building (each rank builds its shard); under pipeline
parallelism each stage builds only its layers, the others are :class:`~.stages.StageMissingLayer`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..distributed import stage_layer_range
from ..layers import (
    Attention,
    AttentionBackend,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    TorchSDPABackend,
    VocabParallelEmbedding,
)
from ..parallel_state import ParallelState
from .stages import StageMissingLayer


def tp_args(parallel: ParallelState) -> dict[str, Any]:
    """The keyword arguments the kernel's parallel layers take for this rank."""
    return {"tp_rank": parallel.tp_rank, "tp_size": parallel.tp_size, "tp_group": parallel.tp_group}


def head_dim_of(config: Any) -> int:
    """``config.head_dim``, or ``hidden_size // num_attention_heads`` when the config has none."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_windows_of(config: Any, max_position: int) -> list[int | None]:
    """Each layer's sliding window (None: full causal attention). ``layer_types`` (Qwen2) marks the
    ``sliding_attention`` layers; a window at least ``max_position`` long is dropped (it hides nothing)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    windows = []
    for i in range(config.num_hidden_layers):
        w = window if layer_types is None or layer_types[i] == "sliding_attention" else None
        windows.append(w if w is not None and w < max_position else None)
    return windows


class DecoderAttention(nn.Module):
    """Self-attention: fused qkv projection, RoPE, paged attention, output projection.

    :param qkv_bias: biases on the q/k/v projections; ``o_bias`` on the output projection.
    """

    def __init__(self, config: Any, max_position: int, sliding_window: int | None, parallel: ParallelState,
                 backend: AttentionBackend, qkv_bias: bool = False, o_bias: bool = False) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias, **tp_args(parallel))
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=o_bias,
                                        **tp_args(parallel))
        self.num_heads = self.qkv_proj.num_heads
        """Query heads on this rank."""
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        """Key/value heads on this rank."""
        self.head_dim = head_dim
        """Size of each head."""
        self.rotary_emb = RotaryEmbedding.from_config(config, head_dim, max_position)
        self.attn = Attention(self.num_heads, head_dim, head_dim**-0.5, self.num_kv_heads, sliding_window, backend)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                metadata: Any) -> torch.Tensor:
        """``[tokens, hidden]`` → ``[tokens, hidden]``; stores the tokens' K/V in ``kv_cache``."""
        qkv = self.qkv_proj(hidden)
        tokens, heads, kv_heads, head_dim = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qk_width = (heads + kv_heads) * head_dim
        # q and k sit side by side in the fused output: rotate them in one go. (narrow, not slicing or
        # split: a decode step runs this once per layer, and those cost a few µs more each.)
        qk = self.rotary_emb.rotate(positions, qkv.narrow(1, 0, qk_width).view(tokens, heads + kv_heads, head_dim))
        q, k = qk.narrow(1, 0, heads), qk.narrow(1, heads, kv_heads)
        v = qkv.narrow(1, qk_width, kv_heads * head_dim).view(tokens, kv_heads, head_dim)
        return self.o_proj(self.attn(q, k, v, kv_cache, metadata))


class GatedMLP(nn.Module):
    """The gated MLP: ``down(silu(gate(x)) * up(x))`` with gate and up fused.

    :param intermediate_size: width of the gate and up projections (default ``config.intermediate_size``).
    :param bias: biases on all three projections (default ``config.mlp_bias``).
    """

    fused_projections = ("gate_up_proj", "down_proj")
    """The child layers that run back to back with only the activation between: a quantization
    method gives them one kernel family, so a compile backend may run the MLP as one fused call."""

    def __init__(self, config: Any, parallel: ParallelState, intermediate_size: int | None = None,
                 bias: bool | None = None) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported by the decoder's gated MLP "
                             "(only 'silu')")
        bias = bool(getattr(config, "mlp_bias", False)) if bias is None else bias
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=bias,
                                                       **tp_args(parallel))
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias, **tp_args(parallel))
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[tokens, hidden]`` → ``[tokens, hidden]``."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``, the residual adds fused into the norms.

    :param self_attn: the layer's attention; ``mlp`` its feed-forward block.
    """

    def __init__(self, config: Any, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
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


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm — those of them on this pipeline stage.

    :param layers: builds decoder layer ``i`` (called only for this stage's layers).
    """

    def __init__(self, config: Any, parallel: ParallelState, layers: Any) -> None:
        super().__init__()
        self.start_layer, self.end_layer = stage_layer_range(config.num_hidden_layers, parallel.pp_rank,
                                                             parallel.pp_size)
        """This stage's decoder layers are ``layers[start_layer:end_layer]``; the rest are placeholders."""
        # The last stage keeps a tied embedding: it is the LM head's weight.
        tied = bool(getattr(config, "tie_word_embeddings", False))
        has_embedding = parallel.is_first_stage or (tied and parallel.is_last_stage)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, **tp_args(parallel))
                             if has_embedding else StageMissingLayer())
        self.layers = nn.ModuleList(layers(i) if self.start_layer <= i < self.end_layer else StageMissingLayer()
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if parallel.is_last_stage else StageMissingLayer()


class DecoderForCausalLM(nn.Module):
    """A decoder-only causal LM over a flattened, paged batch (:class:`~modelrunner.ForwardBatch`).

    :param config: the checkpoint's transformers config.
    :param max_position: longest sequence the model will see (size of the RoPE table).
    :param parallel: this process's tensor-parallel rank and pipeline stage; layers are built for them.
    :param attn_backend: the attention implementation every layer uses (the load hook's
        ``attention_backend``).
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
        self.attn_backend = attn_backend or TorchSDPABackend()
        """The attention implementation every layer uses; builds the per-step metadata."""
        windows = sliding_windows_of(config, max_position)
        self.attn_backend.check_model(windows)
        self.model = DecoderModel(config, parallel, lambda i: DecoderLayer(
            config, self.make_attention(config, i, max_position, windows[i]), self.make_mlp(config, i)))
        self.sliding_windows = tuple(sorted(set(windows), key=lambda w: -1 if w is None else w))
        """The distinct sliding windows of the layers (None = full attention)."""
        self.lm_head = (ParallelLMHead(config.vocab_size, config.hidden_size, **tp_args(parallel))
                        if parallel.is_last_stage else StageMissingLayer())
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        """Whether the LM head shares the embedding's parameter."""
        if self.tie_word_embeddings and parallel.is_last_stage:
            self.lm_head.tie(self.model.embed_tokens)

    # -- what subclasses change --------------------------------------------------------------------

    def attention_biases(self, config: Any) -> tuple[bool, bool]:
        """``(qkv_bias, o_bias)``: ``attention_bias`` on all four projections by default."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def make_attention(self, config: Any, layer: int, max_position: int, sliding_window: int | None) -> nn.Module:
        """The attention of decoder layer ``layer``."""
        qkv_bias, o_bias = self.attention_biases(config)
        return DecoderAttention(config, max_position, sliding_window, self.parallel, self.attn_backend,
                                qkv_bias=qkv_bias, o_bias=o_bias)

    def make_mlp(self, config: Any, layer: int) -> nn.Module:
        """The feed-forward block of decoder layer ``layer``."""
        return GatedMLP(config, self.parallel)

    # -- running -------------------------------------------------------------------------------------

    @property
    def ignored_weights(self) -> tuple[str, ...]:
        """Checkpoint name suffixes not loaded (RoPE tables; the LM head when tied)."""
        return ("rotary_emb.inv_freq",) + (("lm_head.weight",) if self.tie_word_embeddings else ())

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings ``[tokens, hidden]`` of token ids (what :meth:`forward` starts from)."""
        return self.model.embed_tokens(input_ids)

    def forward(self, batch: Any, kv_caches: list[torch.Tensor], inputs_embeds: torch.Tensor | None = None,
                stage_inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
        """Final hidden states ``[tokens, hidden]`` of the batch's flattened tokens; on a pipeline
        stage other than the last, ``{"hidden_states", "residual"}`` for the next stage.

        :param batch: the step's :class:`~modelrunner.forward_batch.ForwardBatch`.
        :param kv_caches: one ``[2, num_blocks, block_size, kv_heads, head_dim]`` tensor per layer of this stage.
        :param inputs_embeds: ``[tokens, hidden]`` embeddings to start from instead of
            ``embed_input_ids(batch.input_ids)`` (a multimodal model writes image features into them).
        :param stage_inputs: on a stage after the first, what the previous stage returned; when
            absent there (a dummy step, e.g. the runner's memory profile) the stage starts from zeros.
        """
        # A list, not a ModuleList slice: slicing builds a new ModuleList (tens of µs) every step.
        layers = list(self.model.layers)[self.model.start_layer:self.model.end_layer]
        if len(kv_caches) != len(layers):
            raise ValueError(f"expected {len(layers)} KV-cache tensors (one per layer), got {len(kv_caches)}")
        metadata = self.attn_backend.build_metadata(batch, self.sliding_windows)
        positions = batch.positions
        if self.parallel.is_first_stage:
            hidden = self.model.embed_tokens(batch.input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        elif stage_inputs is not None:
            hidden, residual = stage_inputs["hidden_states"], stage_inputs["residual"]
        else:
            weight = layers[0].input_layernorm.weight
            hidden = torch.zeros(batch.input_ids.shape[0], self.config.hidden_size, dtype=weight.dtype,
                                 device=weight.device)
            residual = torch.zeros_like(hidden)
        return self.run_layers(layers, positions, hidden, residual, kv_caches, metadata)

    def run_layers(self, layers: list[nn.Module], positions: torch.Tensor, hidden: torch.Tensor,
                   residual: torch.Tensor | None, kv_caches: list[torch.Tensor],
                   metadata: Any) -> torch.Tensor | dict[str, torch.Tensor]:
        """What :meth:`forward` returns, from this stage's ``layers`` (with their ``kv_caches``) onwards:
        the decoder layers, then the final norm on the last stage. ``residual`` is None where
        ``hidden`` is the embeddings. (A compile backend may bind its own onto the instance, e.g. to
        replay recorded decode steps.)"""
        for layer, kv_cache in zip(layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata)
        if not self.parallel.is_last_stage:
            return {"hidden_states": hidden, "residual": residual}
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits ``[rows, vocab_size]`` for final hidden states ``[rows, hidden]``."""
        return self.lm_head(hidden)
