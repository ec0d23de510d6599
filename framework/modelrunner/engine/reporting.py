"""What the engine reports: a request's :class:`~.outputs.RequestOutput` (its text and tokens so far,
and what is new since the last one it reported) and the KV-cache pool's statistics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from .detokenizer import text_delta
from .outputs import CompletionOutput, RequestOutput
from .sequence import Request, Sequence


def request_output(request: Request, longest_stop_string: Callable[[Sequence], int]) -> RequestOutput:
    """``request``'s output now, one completion per sequence, and the deltas since its last output
    (which this marks as sent). Text that may still become part of a stop string (up to
    ``longest_stop_string(seq)`` characters) is held back."""
    completions = []
    for seq in request.seqs:
        delta = text_delta(seq, longest_stop_string(seq))
        sent = seq.sent_token_len
        new_ids = seq.token_ids[seq.prompt_len + sent:]
        seq.sent_token_len = sent + len(new_ids)
        completions.append(CompletionOutput(
            index=seq.index,
            text=seq.output_text[:seq.sent_text_len],
            token_ids=seq.output_token_ids,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            delta_text=delta,
            delta_token_ids=new_ids,
            logprobs=None if seq.logprobs is None else list(seq.logprobs),
            cumulative_logprob=seq.cumulative_logprob,
            delta_logprobs=None if seq.logprobs is None else seq.logprobs[sent:],
        ))
    completions.sort(key=lambda c: c.index)
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=list(request.prompt_token_ids),
        outputs=completions,
        finished=request.is_finished,
        num_cached_tokens=request.seqs[0].num_cached_tokens,
        error=request.error,
        prompt_logprobs=None if request.prompt_logprobs is None else list(request.prompt_logprobs),
        metrics=attrs.evolve(request.metrics),
    )


__all__ = ["request_output"]


def memory_stats(allocator: Any, scheduler: Any, executor: Any, allocator_name: str) -> dict[str, Any]:
    """The KV-cache pool's statistics (blocks used/free/cached, peak, prefix hits, fragmentation), its
    size in bytes, and the scheduler's queue lengths (``LLMEngine.memory_stats``)."""
    stats = dict(allocator.stats().as_dict())
    spec = executor.kv_cache_spec
    stats["allocator"] = allocator_name
    stats["kv_cache_bytes"] = executor.kv_cache_bytes
    stats["bytes_per_token"] = spec.bytes_per_token if spec else 0
    stats["num_waiting_seqs"] = len(scheduler.waiting)
    stats["num_running_seqs"] = len(scheduler.running)
    stats["num_preemptions"] = scheduler.num_preemptions
    return stats
