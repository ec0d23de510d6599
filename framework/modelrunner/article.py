"""The article's convenience API on top of ``execute_model``: ``forward(input_ids)`` → logits of every
position, ``generate(input_ids)`` → new token ids.

``forward`` runs scratch sequences through the KV cache's block allocator: the one of the engine
attached to this object (so they never touch blocks the engine's requests hold), else one made for
this purpose from the configured allocator plugin. ``generate`` is a thin wrapper over that engine
(:meth:`~modelrunner.engine.LLMEngine.generate_token_ids`); an object no engine runs gets one of its
own on first use. They are meant for tests, notebooks and the article's examples; serving goes
through :class:`~modelrunner.engine.LLMEngine`. Not thread-safe with a running engine loop.
"""

from __future__ import annotations

import itertools
from typing import Any

import attrs
import torch

from .errors import ModelRunnerError
from .forward_batch import ForwardBatch, ForwardOutput
from .sampling.params import SamplingParams

_scratch_ids = itertools.count()


def _scratch_id() -> int:
    return -1_000_000 - next(_scratch_ids)  # never an engine's (engines count up from 0)


ENGINE_FACTORY: list[Any] = []
"""The engine class :meth:`ArticleAPI.engine` builds (``modelrunner.engine.llm_engine`` puts
:class:`~modelrunner.engine.LLMEngine` here when it is imported: the engine sits above the runner
and the executor, so this module cannot import it)."""


class ArticleAPI:
    """``forward`` and ``generate`` for anything with ``execute_model`` and a KV cache.

    The class using it provides ``execute_model(batch) -> ForwardOutput``, ``loaded``, ``config``,
    ``block_size``, ``plugins``, ``num_blocks``, ``max_model_len`` and ``kv_cache_spec``.
    """

    _lent_allocator: Any = None
    _own_allocator: Any = None
    _engine: Any = None

    def lend_allocator(self, allocator: Any) -> None:
        """Use ``allocator`` (an engine's) for scratch sequences from now on; the engine owns it."""
        self._lent_allocator = allocator
        self._own_allocator = None

    def attach_engine(self, engine: Any) -> None:
        """Run :meth:`generate` through ``engine`` and scratch sequences through its allocator (an
        :class:`~modelrunner.engine.LLMEngine` calls this on the executor it runs)."""
        self._engine = engine
        self.lend_allocator(engine.allocator)

    def engine(self) -> Any:
        """The :class:`~modelrunner.engine.LLMEngine` that runs this object: the one attached, else one
        made now (it attaches itself, and its allocator then also serves :meth:`forward`)."""
        if self._engine is None:
            if not ENGINE_FACTORY:
                raise ModelRunnerError("no engine class is available: import modelrunner (or "
                                       "modelrunner.engine) before calling generate()")
            ENGINE_FACTORY[0](self)
        return self._engine

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
        """Generate up to ``max_new_tokens`` after ``input_ids`` on the :meth:`engine`; returns the new
        ids (a row stops at EOS unless ``ignore_eos``, at one of ``stop_token_ids``, or at a stop string).

        ``input_ids`` is one prompt (``[L]``: returns a tensor) or several (``[B, L]`` or a list of
        lists of any lengths: returns a list of tensors). Keyword arguments are
        :class:`~modelrunner.SamplingParams` fields (``temperature`` defaults to 0: greedy); ``n``
        and ``max_tokens`` are not among them (one completion each, ``max_new_tokens`` long at most).
        """
        self._require_loaded()
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
        if max(len(r) for r in rows) + max_new_tokens > self.max_model_len:
            raise ValueError(f"prompt + max_new_tokens exceeds max_model_len={self.max_model_len}")
        tensors = [torch.tensor(t, dtype=torch.long) for t in self.engine().generate_token_ids(rows, params)]
        return tensors if nested else tensors[0]
