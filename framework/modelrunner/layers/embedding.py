"""Token embedding and LM head, split by vocabulary rows across a tensor-parallel group.

Rank ``r`` of ``n`` holds the rows ``[r * per_rank, (r + 1) * per_rank)`` of the (padded) vocabulary.
The embedding masks token ids outside its range and all-reduces; the LM head computes logits for its
rows and all-gathers them. Tied embeddings share one parameter, so the split is the same.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .dense import dense
from .linear import Placement, all_gather_last_dim, place


class VocabParallelEmbedding(nn.Module):
    """An embedding table whose rows (the vocabulary) are split across tensor-parallel ranks.

    :param num_embeddings: vocabulary size of the checkpoint.
    :param embedding_dim: hidden size.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_rank: int = 0, tp_size: int = 1,
                 tp_group: Any = None) -> None:
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
        self.num_embeddings = num_embeddings
        """Rows of the checkpoint's table (the vocabulary size)."""
        self.embedding_dim = embedding_dim
        """Width of each row."""
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        self.num_embeddings_per_partition = -(-num_embeddings // tp_size)
        """Rows held by each rank (the vocabulary is zero-padded up to a multiple of ``tp_size``)."""
        self.vocab_start = tp_rank * self.num_embeddings_per_partition
        """First vocabulary row held by this rank."""
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        """One past the last real vocabulary row held by this rank."""
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.quant_scheme: Any = None
        """How a quantization method stores this table (and multiplies it, as an LM head); None: floats."""
        self.compute_dtype: torch.dtype | None = None
        """The dtype a quantized table's rows are returned in: the model's (set by
        :func:`~modelrunner.loading.weights.materialize`); None: as the scheme dequantizes them (float32)."""

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        """Copy this rank's vocabulary rows of the full checkpoint table; padding rows become zero."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} is not packed; got shard {shard_id!r}")
        rows = self.vocab_end - self.vocab_start
        place(param, loaded_weight, Placement((self.num_embeddings, self.embedding_dim),
                                              src=(0, self.vocab_start, rows), dst=(0, rows)))
        padding = [param] + [getattr(self, name, None) for name in ("weight_scales", "weight_mins")
                             if getattr(param, "quant_loader", None) is not None]
        with torch.no_grad():
            for tensor in padding:
                if tensor is not None:
                    tensor.data.narrow(0, rows, tensor.shape[0] - rows).zero_()

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of this rank's table (dequantized when the table is quantized)."""
        if self.quant_scheme is not None:
            rows = self.quant_scheme.embed(self, ids)
            dtype = self.compute_dtype
            return rows if dtype is None or rows.dtype is dtype else rows.to(dtype)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[..., embedding_dim]`` of ``input_ids`` (summed across ranks when split)."""
        if self.tp_size == 1:
            return self.lookup(input_ids)
        import torch.distributed as dist

        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = self.lookup(local).masked_fill(outside.unsqueeze(-1), 0.0)
        dist.all_reduce(out, group=self.tp_group)
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_rank}/{self.tp_size}"


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection to vocabulary logits, split by vocabulary rows like the embedding.

    For tied embeddings call :meth:`tie` with the embedding so both use one parameter.

    :param bias: add a (vocabulary-split) bias to the logits.
    """

    DENSE_WEIGHTS = ("weight",)
    """Parameters :func:`~modelrunner.layers.dense.prepack_weights` packs (forward passes them to ``dense``)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, **tp: Any) -> None:
        super().__init__(num_embeddings, embedding_dim, **tp)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.num_embeddings_per_partition), requires_grad=False)
            self.bias.weight_loader = self._bias_loader

    def _bias_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if tuple(loaded_weight.shape) != (self.num_embeddings,):
            raise ValueError(f"expected shape {[self.num_embeddings]}, got {list(loaded_weight.shape)}")
        rows = self.vocab_end - self.vocab_start
        with torch.no_grad():
            param.data.zero_()
            param.data.narrow(0, 0, rows).copy_(loaded_weight.narrow(0, self.vocab_start, rows))

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        """Share ``embedding``'s weight (``tie_word_embeddings``); the checkpoint's ``lm_head`` is then unused."""
        if embedding.weight.shape != self.weight.shape:
            raise ValueError(f"cannot tie LM head {list(self.weight.shape)} to embedding {list(embedding.weight.shape)}")
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits ``[tokens, num_embeddings]`` (every rank returns all of them when split)."""
        scheme = self.quant_scheme
        logits = dense(hidden_states, self.weight, self.bias) if scheme is None else \
            scheme.apply(self, hidden_states, self.bias)
        if self.tp_size > 1:
            logits = all_gather_last_dim(logits, self.tp_size, self.tp_group)
        if logits.shape[-1] != self.num_embeddings:
            logits = logits[..., : self.num_embeddings]
        return logits
