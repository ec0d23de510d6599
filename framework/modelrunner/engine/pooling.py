"""Embedding (pooling) requests inside the engine, as vLLM runs them beside generation.

A pooling request is scheduled like any prompt (chunked prefill, the same token budget and KV
blocks) but samples nothing. Each step that computes some of its prompt asks the model for the final
hidden states of the rows its pooling method reads (``ForwardBatch.extra[RETURN_HIDDEN_STATES]``);
they are kept on the CPU, at their prompt positions, so a preempted and recomputed prompt simply
writes them again. The step that computes its last prompt token pools them, truncates and normalises
the vector, and finishes the request (``finish_reason="stop"``).

Prefix caching: the last token of a prompt is always computed, so requests whose method reads only
``last`` share cached prefixes like any prompt; the others get a prefix-cache key of their own (as
``prompt_logprobs`` requests do), since a cached token's hidden state is never computed.

An encoder (``LoadedModel.causal`` False: BERT and its kin, through the generic transformers adapter)
attends in both directions, so its prompts are computed in one step each, never in chunks
(``PoolingState.whole_prompt``); its default method is ``cls``, as vLLM's, and it does not generate.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from ..config import PoolerConfig
from ..forward_batch import (
    HIDDEN_STATES,
    RETURN_HIDDEN_STATES,
    ForwardBatch,
    ForwardOutput,
)
from ..pooling.checkpoint import DEFAULT_METHOD, checkpoint_pooling
from ..pooling.method import PoolingContext, PoolingMethod, finish_embedding, rows_read
from ..pooling.outputs import PoolingOutput, PoolingRequestOutput
from ..pooling.params import PoolingParams, check_dimensions, matryoshka_dimensions


@attrs.define(eq=False)
class PoolingState:
    """One pooling request's parameters and what its steps computed so far."""

    params: PoolingParams
    """The validated parameters, ``normalize`` resolved."""
    positions: range
    """The prompt positions whose hidden states are kept (what the method reads; all for ``token_embed``)."""
    whole_prompt: bool = False
    """Compute the prompt in one step (an encoder's: every token attends to every other)."""
    rows: torch.Tensor | None = None
    """float32 ``[len(positions), hidden]`` on the CPU, filled as steps compute them."""
    data: torch.Tensor | None = None
    """The finished embedding."""


class EnginePooler:
    """The engine's side of pooling: which rows a step must return, keeping them, and pooling.

    :param plugins: where the pooling methods come from.
    :param config: the ``pooler_config`` (method, default normalisation).
    :param loaded: the loaded model (its config and tokenizer).
    :param source: the checkpoint (its sentence-transformers files give the defaults), or None.
    :param max_step_tokens: the most tokens one step computes (``max_num_batched_tokens``): an
        encoder's prompt must fit.
    """

    def __init__(self, plugins: Any, config: PoolerConfig, loaded: Any, source: Any = None,
                 max_step_tokens: int | None = None) -> None:
        directory = getattr(source, "path", None)
        declared = checkpoint_pooling(directory if directory is not None and directory.is_dir() else None)
        self.plugins = plugins
        self.causal: bool = bool(getattr(loaded, "causal", True))
        """False for an encoder: prompts in one step each, ``cls`` by default, no generation."""
        self.max_step_tokens = max_step_tokens
        """The most tokens a step computes (an encoder's prompt must fit)."""
        self.method_name: str = config.pooling_type or declared.method or (DEFAULT_METHOD if self.causal else "cls")
        """The pooling method's name (config, else the checkpoint's, else ``last``)."""
        self.method_source = ("the pooling_type config field" if config.pooling_type else
                              declared.source if declared.method else "the default")
        """Where :attr:`method_name` came from (named when it is not installed)."""
        self.normalize: bool = next(v for v in (config.normalize, declared.normalize, True) if v is not None)
        """Whether embeddings are L2-normalised when a request does not say."""
        text = getattr(loaded.hf_config, "get_text_config", lambda: loaded.hf_config)()
        self.context = PoolingContext(int(getattr(text, "hidden_size", 0) or 0), loaded.tokenizer, loaded.hf_config)
        """What the method is told about the model."""
        self.matryoshka = matryoshka_dimensions(text)
        """The output sizes the model allows (see :func:`~modelrunner.pooling.matryoshka_dimensions`)."""
        self.model_name: str = getattr(source, "name", "") or getattr(text, "model_type", "?")
        """Named in errors."""
        self._method: PoolingMethod | None = None
        if config.pooling_type is not None:
            self.method  # noqa: B018 - a configured name that is not installed fails when the engine starts

    @property
    def method(self) -> PoolingMethod:
        """The pooling method instance (created on first use).

        :raises UnknownNameError: (a ValueError) no installed plugin provides it; the message lists those that do.
        """
        if self._method is None:
            try:
                cls = self.plugins.pooling_method_class(self.method_name)
            except ValueError as e:
                raise type(e)(f"pooling method {self.method_name!r} (from {self.method_source}): {e}") from None
            self._method = cls(self.context)
        return self._method

    # -- requests ----------------------------------------------------------------------------------

    def start(self, params: PoolingParams, num_prompt_tokens: int) -> PoolingState:
        """The state of a new request, its parameters checked against the model.

        :raises ValueError: a bad field (named), ``dimensions`` the model does not allow, or a method
            that is not installed.
        """
        params = params.clone().validate()
        method = self.method
        if params.normalize is None:
            params.normalize = self.normalize
        size = self.context.hidden_size if params.task == "token_embed" else method.output_size()
        check_dimensions(params.dimensions, self.matryoshka, size, self.model_name)
        reads = "all" if params.task == "token_embed" else method.reads
        if not self.causal and self.max_step_tokens is not None and num_prompt_tokens > self.max_step_tokens:
            raise ValueError(f"prompt has {num_prompt_tokens} tokens; model {self.model_name!r} is an encoder "
                             f"(bidirectional attention), which computes a prompt in one step: at most "
                             f"max_num_batched_tokens={self.max_step_tokens} tokens (or set truncate_prompt_tokens)")
        return PoolingState(params, rows_read(reads, num_prompt_tokens), whole_prompt=not self.causal)

    def prefix_cache_key(self, state: PoolingState, request_id: str) -> tuple:
        """Extra prefix-cache keys of a request: none when it keeps only the last token's row of a causal model."""
        last_only = len(state.positions) == 1 and state.positions.start > 0 and not state.whole_prompt
        return () if last_only else (("pooling", request_id),)

    # -- steps -------------------------------------------------------------------------------------

    def ask(self, batch: ForwardBatch, scheduled: list[Any]) -> tuple[ForwardBatch, list[tuple[Any, list[int]]]]:
        """``batch`` asking for the hidden states of the rows the step's pooling requests keep, and who
        each asked row belongs to: ``(scheduled item, prompt positions)`` in row order."""
        rows: list[int] = []
        owners: list[tuple[Any, list[int]]] = []
        offset = 0
        for item in scheduled:
            state = item.seq.request.pooling
            if state is not None:
                end = item.start + item.num_new_tokens
                kept = [p for p in state.positions if item.start <= p < end]
                if kept:
                    rows += [offset + p - item.start for p in kept]
                    owners.append((item, kept))
            offset += item.num_new_tokens + len(item.draft)
        if not rows:
            return batch, []
        extra = {**batch.extra, RETURN_HIDDEN_STATES: torch.tensor(rows, dtype=torch.long)}
        return attrs.evolve(batch, extra=extra), owners

    def collect(self, out: ForwardOutput, owners: list[tuple[Any, list[int]]], adapter: str) -> None:
        """Keep the rows a step returned for its pooling requests.

        :raises ValueError: the model returned no (or too few) hidden states: its adapter cannot serve embeddings.
        """
        if not owners:
            return
        hidden = out.aux.get(HIDDEN_STATES)
        wanted = sum(len(kept) for _, kept in owners)
        if hidden is None or hidden.dim() != 2 or hidden.shape[0] != wanted:
            got = "none" if hidden is None else f"shape {list(hidden.shape)}"
            raise ValueError(f"adapter {adapter!r} returned {got} for aux[{HIDDEN_STATES!r}] where {wanted} rows "
                             f"were asked (batch.extra[{RETURN_HIDDEN_STATES!r}]): it cannot serve embeddings")
        hidden = hidden.detach().float().cpu()
        at = 0
        for item, kept in owners:
            state = item.seq.request.pooling
            if state.rows is None:
                state.rows = hidden.new_zeros((len(state.positions), hidden.shape[1]))
            first = state.positions.start
            state.rows[kept[0] - first:kept[-1] - first + 1] = hidden[at:at + len(kept)]
            at += len(kept)

    def finish(self, request: Any) -> None:
        """Pool a request whose whole prompt was computed into ``request.pooling.data``.

        :raises ValueError: the method returned something other than a vector of its ``output_size``.
        """
        state: PoolingState = request.pooling
        params = state.params
        if params.task == "token_embed":
            vector = state.rows
        else:
            vector = self.method.pool(state.rows, request.prompt_token_ids)
            size = self.method.output_size()
            if not isinstance(vector, torch.Tensor) or tuple(vector.shape) != (size,):
                got = f"shape {list(vector.shape)}" if isinstance(vector, torch.Tensor) else type(vector).__name__
                raise ValueError(f"pooling method {self.method_name!r} returned {got}, expected a [{size}] tensor")
        state.data = finish_embedding(vector, params.dimensions, params.normalize)
        state.rows = None

    def output(self, request: Any) -> PoolingRequestOutput:
        """The request's output (its embedding once finished; none when it ended otherwise)."""
        seq = request.seqs[0]
        reason = "error" if request.error else seq.finish_reason
        return PoolingRequestOutput(request_id=request.request_id, outputs=PoolingOutput(request.pooling.data),
                                    prompt_token_ids=list(request.prompt_token_ids), finished=request.is_finished,
                                    finish_reason=reason, error=request.error, num_cached_tokens=seq.num_cached_tokens,
                                    metrics=attrs.evolve(request.metrics))


__all__ = ["EnginePooler", "PoolingState"]
