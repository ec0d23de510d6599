"""Scratch sequences: ``forward(input_ids)`` → logits of every position, and the argument checks of
``generate(input_ids)``, for a runner or an executor (their ``forward`` and ``generate`` delegate here).

A scratch sequence is not an engine's request: it is allocated KV blocks, run through the owner's
``execute_model`` in one step, and freed. Its blocks come from the block allocator of the engine that
runs the owner (lent with :meth:`ScratchSequences.lend`, so they never touch blocks the engine's
requests hold), else from one made for this purpose from the configured allocator plugin. Meant for
tests, notebooks and the article's examples; serving goes through :class:`~modelrunner.engine.LLMEngine`.
Not thread-safe with a running engine loop.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import attrs
import torch

from .errors import ModelRunnerError
from .forward_batch import ForwardBatch, ForwardOutput
from .sampling.params import SamplingParams

_scratch_ids = itertools.count()


def _scratch_id() -> int:
    return -1_000_000 - next(_scratch_ids)  # never an engine's (engines count up from 0)


def no_engine_error(owner: Any) -> ModelRunnerError:
    """The error of ``engine()`` (and so of ``generate()``) on a runner or executor no engine runs."""
    return ModelRunnerError(
        f"no engine runs this {type(owner).__name__}: use modelrunner.ModelRunner (its engine() builds one on "
        "first use) or modelrunner.LLM (llm.runner.engine() is its engine), or build modelrunner.LLMEngine(it)")


class ScratchSequences:
    """Runs scratch sequences for ``owner`` (a runner or an executor) and checks ``generate``'s arguments.

    ``owner`` provides ``execute_model(batch) -> ForwardOutput``, ``_require_loaded()``, ``loaded``, ``config``, ``block_size``,
    ``plugins``, ``num_blocks``, ``max_model_len`` and ``kv_cache_spec``.
    """

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        """The runner or executor whose ``execute_model`` runs the scratch sequences."""
        self.lent_allocator: Any = None
        """The block allocator an engine lent (None: :meth:`allocator` makes one of its own)."""
        self._own_allocator: Any = None

    def lend(self, allocator: Any) -> None:
        """Use ``allocator`` (an engine's) for scratch sequences from now on; the engine owns it."""
        self.lent_allocator = allocator
        self._own_allocator = None

    def allocator(self) -> Any:
        """The block allocator scratch sequences use: the one lent, else one made from the allocator plugin."""
        if self.lent_allocator is not None:
            return self.lent_allocator
        if self._own_allocator is None:
            owner = self.owner
            cache = owner.config.cache
            if owner.kv_cache_spec is None:
                cache = attrs.evolve(cache, enable_prefix_caching=False)
            self._own_allocator = owner.plugins.create_allocator(cache.kv_allocator, owner.num_blocks,
                                                                 owner.block_size, owner.max_model_len, cache)
        return self._own_allocator

    def forward(self, input_ids: torch.Tensor | list, return_router_logits: bool = False
                ) -> torch.Tensor | dict[str, Any]:
        """Logits for every position of ``input_ids`` (``[L]`` or ``[B, L]``): ``[B, L, vocab]``.

        With ``return_router_logits`` (MoE models): ``{"logits": [B, L, vocab], "router_logits":
        one [B, L, num_experts] tensor per MoE layer}``.
        """
        loaded = self.owner._require_loaded()
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2 or ids.shape[1] == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be integer token ids of shape [L] or [B, L] with L > 0, got "
                             f"{str(ids.dtype).removeprefix('torch.')} of shape {tuple(ids.shape)}")
        vocab = loaded.vocab_size
        if bool((ids < 0).any()) or bool((ids >= vocab).any()):
            bad = int(ids[(ids < 0) | (ids >= vocab)][0])
            raise ValueError(f"input_ids holds token id {bad}, outside the vocabulary (accepted: 0 … {vocab - 1})")
        extra = {"return_router_logits": True} if return_router_logits else {}
        logits, routers = [], []
        for row in ids.tolist():  # one sequence at a time: scratch blocks for one row at most
            out, seq_ids = self._run([row], extra, [list(range(len(row)))])
            self._free(self.allocator(), seq_ids)
            logits.append(out.logits)
            routers.append(out.aux.get("router_logits"))
        if not return_router_logits:
            return torch.stack(logits)
        if any(r is None for r in routers):
            raise ModelRunnerError(f"the {loaded.adapter!r} adapter returned no router_logits (not an MoE model?)")
        return {"logits": torch.stack(logits), "router_logits": [torch.stack(layer) for layer in zip(*routers)]}

    def generate(self, engine: Callable[[], Any], input_ids: torch.Tensor | list, max_new_tokens: int = 16,
                 **sampling: Any) -> torch.Tensor | list[torch.Tensor]:
        """Check ``generate``'s arguments, then run them on ``engine()`` (asked for only once they are
        valid); returns the new ids of each prompt, as ``ModelRunner.generate`` documents."""
        self.owner._require_loaded()
        if isinstance(input_ids, torch.Tensor):
            input_ids = input_ids.tolist()
        nested = bool(input_ids) and isinstance(input_ids[0], (list, tuple))
        rows = [list(r) for r in (input_ids if nested else [input_ids])]
        fields = set(attrs.fields_dict(SamplingParams)) - {"n", "max_tokens"}
        unsupported = sorted(set(sampling) - fields)
        if unsupported:
            raise ValueError(f"ModelRunner.generate takes SamplingParams fields but n and max_tokens (use "
                             f"max_new_tokens); got {unsupported}")
        params = SamplingParams(**{"temperature": 0.0, **sampling, "max_tokens": max_new_tokens})
        for row in rows:
            if not row:
                raise ValueError("every prompt needs at least one token id")
        max_model_len = self.owner.max_model_len
        if max(len(r) for r in rows) + max_new_tokens > max_model_len:
            raise ValueError(f"prompt + max_new_tokens exceeds max_model_len={max_model_len}")
        tensors = [torch.tensor(t, dtype=torch.long) for t in engine().generate_token_ids(rows, params)]
        return tensors if nested else tensors[0]

    def _run(self, rows: list[list[int]], extra: dict[str, Any], logits_rows: list[list[int]]
             ) -> tuple[ForwardOutput, list[int]]:
        allocator = self.allocator()
        ids = [_scratch_id() for _ in rows]
        try:
            for seq_id, tokens in zip(ids, rows):
                # No prefix reuse: every position's logits are computed.
                allocator.allocate(seq_id, tokens, extra_keys=("scratch", seq_id))
            batch = ForwardBatch.build(ids, rows, [0] * len(rows), [allocator.block_table(i) for i in ids],
                                       self.owner.block_size, logits_rows, extra=extra)
            return self.owner.execute_model(batch), ids
        except BaseException:
            self._free(allocator, ids)
            raise

    def _free(self, allocator: Any, ids: list[int]) -> None:
        for seq_id in ids:
            if seq_id in allocator:
                allocator.free(seq_id)
        loaded = self.owner.loaded
        caches = loaded.extra.get("caches") if loaded is not None else None
        if isinstance(caches, dict):  # a model that keeps its own per-sequence caches
            for seq_id in ids:
                caches.pop(seq_id, None)


__all__ = ["ScratchSequences", "no_engine_error"]
