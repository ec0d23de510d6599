"""The article's convenience API on top of ``execute_model``: ``forward(input_ids)`` → logits of every
position, ``generate(input_ids)`` → new token ids.

Both run scratch sequences through the KV cache's block allocator: the one an engine lends its
executor (so they never touch blocks the engine's requests hold), else one made for this purpose
from the configured allocator plugin. They are meant for tests, notebooks and the article's
examples; serving goes through :class:`~modelrunner.engine.LLMEngine`. Not thread-safe with a
running engine loop.
"""

from __future__ import annotations

import itertools
from typing import Any

import attrs
import torch

from .errors import ModelRunnerError
from .forward_batch import ForwardBatch, ForwardOutput
from .layers.sampler import Sampler, SamplingMetadata
from .sampling.params import SamplingParams

_scratch_ids = itertools.count()


def _scratch_id() -> int:
    return -1_000_000 - next(_scratch_ids)  # never an engine's (engines count up from 0)


class ArticleAPI:
    """``forward`` and ``generate`` for anything with ``execute_model`` and a KV cache.

    The class using it provides ``execute_model(batch) -> ForwardOutput``, ``loaded``, ``config``,
    ``block_size``, ``plugins``, ``num_blocks``, ``max_model_len`` and ``kv_cache_spec``.
    """

    _lent_allocator: Any = None
    _own_allocator: Any = None

    def lend_allocator(self, allocator: Any) -> None:
        """Use ``allocator`` (an engine's) for scratch sequences from now on; the engine owns it."""
        self._lent_allocator = allocator
        self._own_allocator = None

    def scratch_allocator(self) -> Any:
        """The block allocator scratch sequences use: the one an engine lent, else this object's own."""
        if self._lent_allocator is not None:
            return self._lent_allocator
        if self._own_allocator is None:
            cache = self.config.cache
            if self.kv_cache_spec is None:
                cache = attrs.evolve(cache, enable_prefix_caching=False)
            self._own_allocator = self.plugins.create_allocator(cache.kv_allocator, self.num_blocks, self.block_size,
                                                                self.max_model_len, cache)
        return self._own_allocator

    def _run_scratch(self, rows: list[list[int]], extra: dict[str, Any], logits_rows: list[list[int]]
                     ) -> tuple[ForwardOutput, list[int]]:
        allocator = self.scratch_allocator()
        ids = [_scratch_id() for _ in rows]
        try:
            for seq_id, tokens in zip(ids, rows):
                # No prefix reuse: every position's logits are computed.
                allocator.allocate(seq_id, tokens, extra_keys=("scratch", seq_id))
            batch = ForwardBatch.build(ids, rows, [0] * len(rows), [allocator.block_table(i) for i in ids],
                                       self.block_size, logits_rows, extra=extra)
            return self.execute_model(batch), ids
        except BaseException:
            self._free_scratch(allocator, ids)
            raise

    def _free_scratch(self, allocator: Any, ids: list[int]) -> None:
        for seq_id in ids:
            if seq_id in allocator:
                allocator.free(seq_id)
        caches = self.loaded.extra.get("caches") if self.loaded is not None else None
        if isinstance(caches, dict):  # a model that keeps its own per-sequence caches
            for seq_id in ids:
                caches.pop(seq_id, None)

    def forward(self, input_ids: torch.Tensor | list, return_router_logits: bool = False) -> torch.Tensor | dict[str, Any]:
        """Logits for every position of ``input_ids`` (``[L]`` or ``[B, L]``): ``[B, L, vocab]``.

        With ``return_router_logits`` (MoE models): ``{"logits": [B, L, vocab], "router_logits":
        one [B, L, num_experts] tensor per MoE layer}``.
        """
        self._require_loaded()
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2 or ids.shape[1] == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be integer token ids of shape [L] or [B, L] with L > 0, got "
                             f"{str(ids.dtype).removeprefix('torch.')} of shape {tuple(ids.shape)}")
        vocab = self.loaded.vocab_size
        if bool((ids < 0).any()) or bool((ids >= vocab).any()):
            bad = int(ids[(ids < 0) | (ids >= vocab)][0])
            raise ValueError(f"input_ids holds token id {bad}, outside the vocabulary (accepted: 0 … {vocab - 1})")
        extra = {"return_router_logits": True} if return_router_logits else {}
        logits, routers = [], []
        for row in ids.tolist():  # one sequence at a time: scratch blocks for one row at most
            out, seq_ids = self._run_scratch([row], extra, [list(range(len(row)))])
            self._free_scratch(self.scratch_allocator(), seq_ids)
            logits.append(out.logits)
            routers.append(out.aux.get("router_logits"))
        if not return_router_logits:
            return torch.stack(logits)
        if any(r is None for r in routers):
            raise ModelRunnerError(f"the {self.loaded.adapter!r} adapter returned no router_logits (not an MoE model?)")
        return {"logits": torch.stack(logits), "router_logits": [torch.stack(layer) for layer in zip(*routers)]}

    def generate(self, input_ids: torch.Tensor | list, max_new_tokens: int = 16,
                 **sampling: Any) -> torch.Tensor | list[torch.Tensor]:
        """Generate up to ``max_new_tokens`` after ``input_ids``, all rows as one static batch; returns
        the new ids (a row stops at EOS unless ``ignore_eos``, or at one of ``stop_token_ids``).

        ``input_ids`` is one prompt (``[L]``: returns a tensor) or several (``[B, L]`` or a list of
        lists of any lengths: returns a list of tensors). Keyword arguments are
        :class:`~modelrunner.SamplingParams` fields among ``temperature`` (default 0: greedy),
        ``top_k``, ``top_p``, ``min_p``, ``seed``, ``ignore_eos`` and ``stop_token_ids``; the rest
        (penalties, stop strings, ``n``) need :class:`~modelrunner.LLM`.
        """
        self._require_loaded()
        if isinstance(input_ids, torch.Tensor):
            input_ids = input_ids.tolist()
        nested = bool(input_ids) and isinstance(input_ids[0], (list, tuple))
        rows = [list(r) for r in (input_ids if nested else [input_ids])]
        simple = {"temperature", "top_k", "top_p", "min_p", "seed", "ignore_eos", "stop_token_ids"}
        unsupported = sorted(set(sampling) - simple)
        if unsupported:
            raise ValueError(f"ModelRunner.generate takes only {', '.join(sorted(simple))}; for {unsupported} "
                             "use LLM(...).generate")
        params = SamplingParams(**{"temperature": 0.0, **sampling, "max_tokens": max_new_tokens})
        for row in rows:
            if not row:
                raise ValueError("every prompt needs at least one token id")
        if max(len(r) for r in rows) + max_new_tokens > self.max_model_len:
            raise ValueError(f"prompt + max_new_tokens exceeds max_model_len={self.max_model_len}")
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.loaded.eos_token_ids))
        sampler = Sampler(seed=self.config.model.seed if params.seed is None else params.seed)
        metadata = SamplingMetadata.from_rows([params.temperature] * len(rows), [params.top_k] * len(rows),
                                              [params.top_p] * len(rows), [None] * len(rows),
                                              [params.min_p] * len(rows))
        allocator = self.scratch_allocator()
        out, ids = self._run_scratch(rows, {}, [[len(r) - 1] for r in rows])
        new: list[list[int]] = [[] for _ in rows]
        try:
            live = list(range(len(rows)))
            logits = out.logits
            while True:
                tokens = sampler(logits, metadata).tolist()
                for i, token in zip(live, tokens):
                    new[i].append(token)
                live = [i for i in live if new[i][-1] not in stops and len(new[i]) < max_new_tokens]
                if not live:
                    break
                for i in live:
                    allocator.append_slots(ids[i], [new[i][-1]])
                batch = ForwardBatch.build([ids[i] for i in live], [[new[i][-1]] for i in live],
                                           [len(rows[i]) + len(new[i]) - 1 for i in live],
                                           [allocator.block_table(ids[i]) for i in live], self.block_size,
                                           [[0]] * len(live))
                logits = self.execute_model(batch).logits
                metadata = attrs.evolve(metadata, temperature=metadata.temperature[:len(live)],
                                        generators=metadata.generators[:len(live)],
                                        **{k: None if getattr(metadata, k) is None else getattr(metadata, k)[:len(live)]
                                           for k in ("top_k", "top_p", "min_p")})
        finally:
            self._free_scratch(allocator, ids)
        tensors = [torch.tensor(t, dtype=torch.long) for t in new]
        return tensors if nested else tensors[0]
