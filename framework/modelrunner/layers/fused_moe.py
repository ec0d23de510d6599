"""The routed experts of a mixture-of-experts layer, dispatched by expert rather than by token.

Each token's ``top_k`` (token, expert) assignments are sorted by expert id, so every expert's
tokens sit in one contiguous slice; each expert that received tokens then runs its gated MLP once,
as two matmuls over its slice (:func:`~modelrunner.layers.dense.dense`), and the outputs are gathered back into
(token, slot) order and summed with their routing weights. The work is proportional to
``tokens × top_k`` (experts with no tokens cost nothing), with one Python iteration per *active*
expert and none per token. (``torch.nn.functional.grouped_mm`` runs the same loop inside ATen on
CPU, through MKL; the explicit loop lets each product use oneDNN, faster there (``bench/moe_layer.py`` measures it).)

Weights use vLLM's layout and names: ``w13_weight`` ``[experts, 2 * intermediate, hidden]`` (gate
rows then up rows, transformers 5's ``experts.gate_up_proj``) and ``w2_weight``
``[experts, hidden, intermediate]`` (``experts.down_proj``). Their weight loaders take either the
fused 3-D checkpoint tensor (``shard_id=None``) or one expert's 2-D projection, with ``shard_id``
its index in :meth:`FusedMoE.packed_modules_mapping` (so :func:`modelrunner.loading.weights.load_weights`
both routes per-expert tensors and reports the missing ones by name).

Tensor parallelism is *expert parallelism*: rank ``r`` of ``tp_size`` holds experts
``[r * E / tp_size, (r + 1) * E / tp_size)`` whole, every rank routes every token (the router is
replicated), computes its own experts' share, and the shares are all-reduced.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from .activation import SiluAndMul
from .dense import dense, dense_plan
from .linear import copy_checked, logical_shape
from .moe_router import check_top_k, select_experts

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
"""The three projections of an expert's gated MLP, as per-expert checkpoints name them."""


def expert_tensor_name(expert: int, projection: str) -> str:
    """The name part one expert's projection goes by in :meth:`FusedMoE.packed_modules_mapping`
    (``expert3_up_proj``); adapters rename their checkpoints' per-expert tensors to it."""
    if projection not in EXPERT_PROJECTIONS:
        raise ValueError(f"unknown expert projection {projection!r}; expected one of {', '.join(EXPERT_PROJECTIONS)}")
    return f"expert{expert}_{projection}"


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_start: int = 0,
    expert_counts: list[int] | None = None,
    quantized: Any = None,
) -> torch.Tensor:
    """``Σ_k weight_k · expert_{id_k}(x)`` for every token, over the experts held in ``w13``/``w2``.

    :param hidden: ``[num_tokens, hidden]``.
    :param w13: ``[local_experts, 2 * intermediate, hidden]``, gate rows then up rows.
    :param w2: ``[local_experts, hidden, intermediate]``.
    :param topk_weights: ``[num_tokens, top_k]`` mixing weights (float32).
    :param topk_ids: ``[num_tokens, top_k]`` global expert ids.
    :param expert_start: global id of ``w13[0]``; assignments to experts outside
        ``[expert_start, expert_start + local_experts)`` contribute nothing here (another rank's).
    :param expert_counts: assignments per global expert id (at least up to the last local expert),
        when the caller already counted them.
    :param quantized: the layer's :class:`~modelrunner_quantization.experts.QuantizedExperts` when its
        stacks are quantized (``w13``/``w2`` are then its storage, multiplied through it).
    :returns: ``[num_tokens, hidden]`` in ``hidden``'s dtype.
    """
    num_tokens, top_k = topk_ids.shape
    num_local = w13.shape[0]
    flat_ids = topk_ids.reshape(-1)
    # Stable, so each expert's slice keeps token order (deterministic results).
    order = torch.argsort(flat_ids, stable=True)
    counts = expert_counts
    if counts is None:
        counts = torch.bincount(flat_ids, minlength=expert_start + num_local).tolist()
    begin = sum(counts[:expert_start])
    local_counts = counts[expert_start:expert_start + num_local]
    num_rows = sum(local_counts)
    rows = order[begin:begin + num_rows]  # flat (token, slot) indices, grouped by expert
    x = hidden.index_select(0, torch.div(rows, top_k, rounding_mode="floor"))
    out = torch.empty_like(x)
    act = SiluAndMul()
    if quantized is None:  # float stacks: each expert's matrices through the plans prepacking attached
        plan13, plan2 = dense_plan(w13), dense_plan(w2)
        packed13 = plan13.packed if plan13 is not None and plan13.packed is not None else [None] * num_local
        packed2 = plan2.packed if plan2 is not None and plan2.packed is not None else [None] * num_local
    start = 0
    for expert, count in enumerate(local_counts):
        if count == 0:
            continue
        end = start + count
        if quantized is not None:
            up = quantized.matmul("w13_weight", expert, x[start:end])
            out[start:end] = quantized.matmul("w2_weight", expert, act(up))
        else:
            up = dense(x[start:end], w13[expert], packed=packed13[expert], plan=plan13)
            out[start:end] = dense(act(up), w2[expert], packed=packed2[expert], plan=plan2)
        start = end
    # Back to (token, slot) order — a gather, with another rank's slots reading a zero row — then
    # the weighted sum over each token's slots, as transformers sums them.
    position = torch.full((num_tokens * top_k,), num_rows, dtype=torch.long, device=hidden.device)
    position[rows] = torch.arange(num_rows, device=hidden.device)
    if num_rows < num_tokens * top_k:
        out = torch.cat((out, out.new_zeros(1, out.shape[1])))
    slots = out.index_select(0, position).view(num_tokens, top_k, hidden.shape[1])
    return (slots * topk_weights.unsqueeze(-1)).sum(dim=1).to(hidden.dtype)


class FusedMoE(nn.Module):
    """The experts of one MoE layer, with their routing: router logits in, mixed expert outputs out.

    :param num_experts: experts of the whole layer (all ranks).
    :param top_k: experts each token is routed to.
    :param hidden_size: model width.
    :param intermediate_size: each expert's MLP width.
    :param renormalize: make each token's ``top_k`` weights sum to one (see :mod:`.moe_router`).
    :param reduce_results: all-reduce the ranks' shares under expert parallelism (turn off to fuse
        the reduction with another one).
    :raises ValueError: ``top_k`` outside ``[1, num_experts]``, or experts that do not divide
        evenly among the ranks.
    """

    DENSE_WEIGHTS = ("w13_weight", "w2_weight")
    """Parameters :func:`~modelrunner.layers.dense.prepack_weights` packs (one matrix per expert)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, reduce_results: bool = True, tp_rank: int = 0, tp_size: int = 1,
                 tp_group: Any = None) -> None:
        super().__init__()
        check_top_k(top_k, num_experts)
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
        if num_experts % tp_size:
            raise ValueError(f"num_experts ({num_experts}) is not divisible by the tensor-parallel size ({tp_size}); "
                             f"expert parallelism gives every rank the same number of whole experts")
        self.num_experts = num_experts
        """Experts of the whole layer."""
        self.top_k = top_k
        """Experts per token."""
        self.hidden_size = hidden_size
        """Model width."""
        self.intermediate_size = intermediate_size
        """Width of each expert's MLP."""
        self.renormalize = renormalize
        """Whether each token's kept weights are rescaled to sum to one."""
        self.reduce_results = reduce_results
        """Whether forward all-reduces the ranks' shares."""
        self.tp_rank = tp_rank
        """This rank's place in the tensor-parallel group (which experts it holds)."""
        self.tp_size = tp_size
        """Size of the tensor-parallel group the experts are partitioned across."""
        self.tp_group = tp_group
        """The torch.distributed group the shares are all-reduced on (None: the default group)."""
        self.num_local_experts = num_experts // tp_size
        """Experts held by this rank."""
        self.expert_start = tp_rank * self.num_local_experts
        """Global id of this rank's first expert."""
        self.w13_weight = nn.Parameter(torch.empty(self.num_local_experts, 2 * intermediate_size, hidden_size),
                                       requires_grad=False)
        self.w13_weight.weight_loader = partial(self._load, "w13")
        self.w2_weight = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, intermediate_size),
                                      requires_grad=False)
        self.w2_weight.weight_loader = partial(self._load, "w2")
        self.register_buffer("expert_token_counts", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.last_expert_token_counts: list[int] = [0] * num_experts
        """Token assignments per expert (all experts, every rank) in the last forward."""
        self.quant_scheme: Any = None
        """How a quantization method stores and multiplies the experts (None: float stacks; see
        :class:`~modelrunner_quantization.experts.QuantizedExperts`)."""

    @staticmethod
    def packed_modules_mapping(num_experts: int) -> dict[str, list[str]]:
        """Fused parameter → its per-expert checkpoint projections (see :func:`expert_tensor_name`), in
        ``shard_id`` order: ``w13_weight`` takes ``2 * e`` (gate) and ``2 * e + 1`` (up), ``w2_weight`` ``e``."""
        return {
            "w13_weight": [expert_tensor_name(e, p) for e in range(num_experts) for p in ("gate_proj", "up_proj")],
            "w2_weight": [expert_tensor_name(e, "down_proj") for e in range(num_experts)],
        }

    def reset_buffers(self) -> None:
        """Zero the expert token counters (after :func:`modelrunner.loading.weights.materialize`)."""
        self.expert_token_counts.zero_()

    def _load(self, which: str, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        inter, hidden = self.intermediate_size, self.hidden_size
        if shard_id is None:  # the fused 3-D tensor of every expert
            full = (self.num_experts, *logical_shape(param)[1:])
            if tuple(loaded_weight.shape) != full:
                raise ValueError(f"expected shape {list(full)}, got {list(loaded_weight.shape)}")
            for local in range(self.num_local_experts):
                self._put(param, loaded_weight[self.expert_start + local], lambda t, e=local: t[e])
            return
        per_expert = 2 if which == "w13" else 1
        if isinstance(shard_id, bool) or not isinstance(shard_id, int) \
                or not 0 <= shard_id < per_expert * self.num_experts:
            raise ValueError(f"shard_id must be an index below {per_expert * self.num_experts}, got {shard_id!r}")
        expert, part = divmod(shard_id, per_expert)
        expected = (inter, hidden) if which == "w13" else (hidden, inter)
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"expected shape {list(expected)} for expert {expert}, got {list(loaded_weight.shape)}")
        local = expert - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert
        if which == "w2":
            self._put(param, loaded_weight, lambda t: t[local])
        else:
            self._put(param, loaded_weight, lambda t: t[local].narrow(0, part * inter, inter))

    @staticmethod
    def _put(param: nn.Parameter, src: torch.Tensor, select: Any) -> None:
        """Copy one expert matrix into the part of ``param`` that ``select`` picks (or quantize it there,
        through the storage's ``quant_loader``)."""
        quant_loader = getattr(param, "quant_loader", None)
        if quant_loader is not None:
            quant_loader(param, src, select)
            return
        with torch.no_grad():
            copy_checked(select(param.data), src)

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """``[tokens, hidden]`` and the router's ``[tokens, num_experts]`` logits → ``[tokens, hidden]``."""
        if router_logits.shape[-1] != self.num_experts:
            raise ValueError(f"router_logits has {router_logits.shape[-1]} experts, the layer {self.num_experts}")
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        counts = torch.bincount(topk_ids.reshape(-1), minlength=self.num_experts)
        self.expert_token_counts += counts
        self.last_expert_token_counts = counts.tolist()
        out = fused_experts(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.expert_start,
                            self.last_expert_token_counts, quantized=self.quant_scheme)
        if self.tp_size > 1 and self.reduce_results:
            import torch.distributed as dist

            dist.all_reduce(out, group=self.tp_group)
        return out

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, renormalize={self.renormalize}, "
                f"local_experts=[{self.expert_start}, {self.expert_start + self.num_local_experts})")
