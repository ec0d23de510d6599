"""LLMEngine: requests in, one batched step at a time, outputs out (vLLM's ``add_request`` / ``step``)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from typing import Any

import torch

from ..errors import FatalError
from ..kv_cache.allocator import KVCacheError
from ..layers.sampler import Sampler, SamplingMetadata
from .batch_builder import build_forward_batch
from .detokenizer import start_detokenizer, text_delta
from .input_processor import InputProcessor
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams
from .scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from .sequence import Request, Sequence, child_seed
from .stop_checker import StopChecker, eos_token_ids

logger = logging.getLogger(__name__)


class LLMEngine:
    """Continuous batching over one loaded :class:`~modelrunner.runner.ModelRunner`.

    ``add_request`` validates and queues a request (a bad one raises ``ValueError`` and leaves
    nothing behind); each ``step`` schedules, runs one forward over the flattened batch, samples
    every finished row at once, and returns a :class:`RequestOutput` for every request that
    changed. Requests may be added between steps.
    """

    def __init__(self, runner: Any) -> None:
        runner.load_model()
        self.runner = runner
        """The model runner (loaded)."""
        self.tokenizer = runner.tokenizer
        """The checkpoint's tokenizer."""
        self.allocator = runner.allocator
        """The runner's KV block allocator."""
        self.max_model_len: int = runner.max_model_len
        """Longest sequence (prompt + output) the runner accepts."""
        self.scheduler = Scheduler(runner.config.scheduler, runner.allocator)
        """Waiting and running queues."""
        self.sampler = Sampler(seed=runner.config.model.seed)
        """Batched sampler; its shared generator serves requests without a seed."""
        self.vocab_size: int = runner.loaded.vocab_size
        """Valid token ids are ``0 … vocab_size - 1``."""
        self.eos_token_ids: frozenset[int] = eos_token_ids(self.tokenizer, runner.loaded.hf_config)
        """Token ids that end a completion unless ``ignore_eos``."""
        self.input_processor = InputProcessor(
            self.tokenizer, self.vocab_size, self.max_model_len,
            runner.allocator.num_blocks * runner.allocator.block_size, runner.config.scheduler.max_num_seqs,
            process_inputs=getattr(runner, "process_inputs", None),
        )
        """Tokenizes and validates new requests."""
        self.stop_checker = StopChecker(self.tokenizer, self.eos_token_ids, self.max_model_len)
        """Appends sampled tokens and decides when sequences end."""
        self._shares_kv_on_fork = runner.loaded.kv_cache_spec is not None
        self._requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._auto_ids = itertools.count()

    # -- requests --------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict[str, Any],
        params: SamplingParams | dict | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Validate and queue a request.

        :param prompt: text, token ids, or ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``
            whose other keys (e.g. ``"images"``) join ``extra``.
        :param params: sampling parameters (None: defaults; a dict is turned into SamplingParams).
        :param extra: adapter inputs passed to the model in ``ForwardBatch.extra``.
        :raises ValueError: duplicate id, empty or too long prompt, token ids outside the
            vocabulary, invalid sampling parameters. Nothing is queued then.
        """
        request_id = str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use; ids must be unique among live requests")
        p = self.input_processor.process(request_id, prompt, params, extra)
        request = Request(
            request_id=request_id, prompt=p.text, prompt_token_ids=p.token_ids, params=p.params,
            arrival=next(self._arrivals), extra=p.extra, extra_keys=p.extra_keys,
        )
        seed = p.params.seed
        generator = None if seed is None else torch.Generator().manual_seed(child_seed(seed, 0))
        seq = Sequence(seq_id=next(self._seq_ids), request=request, index=0, token_ids=list(p.token_ids),
                       generator=generator)
        start_detokenizer(seq)
        request.seqs.append(seq)
        self._requests[request_id] = request
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now; its blocks are freed and the next :meth:`step` reports it
        (``finish_reason="abort"``). Returns False for an unknown or finished id."""
        request = self._requests.pop(str(request_id), None)
        if request is None:
            return False
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        request.forked = True
        self._pending.append(self._output(request))
        return True

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        """Requests waiting or running."""
        return len(self._requests)

    # -- the step --------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return the outputs of every request that changed.

        Each output carries the cumulative text and token ids plus the delta since the last
        report; finished requests appear once more with ``finished=True`` and are then forgotten.
        """
        out = self.scheduler.schedule()
        outputs, self._pending = self._pending, []
        changed: dict[str, Request] = {}
        for seq, reason in out.failed:
            self._fail(seq.request, reason, outputs)
        for seq in out.ended:
            changed[seq.request.request_id] = seq.request
        if not out.is_empty:
            if out.block_copies:
                self.runner.copy_blocks(out.block_copies)
            executed = self._execute(out, outputs)
            if executed is not None:
                logits, rows, scheduled = executed
                for item in scheduled:
                    item.seq.num_computed_tokens = item.start + item.num_new_tokens
                self._sample_and_append(logits, [scheduled[r].seq for r in rows], changed)
        for request in changed.values():
            if request.request_id in self._requests:
                outputs.append(self._output(request))
                if request.is_finished:
                    del self._requests[request.request_id]
        self.scheduler.drop_finished()
        return outputs

    def _execute(
        self, out: SchedulerOutput, outputs: list[RequestOutput]
    ) -> tuple[torch.Tensor, list[int], list[ScheduledSequence]] | None:
        """One forward over the whole batch. If it raises, each request runs alone so that only the
        one(s) that fail are finished with ``finish_reason="error"`` (their KV slots are rewritten
        identically by the retry, so the others are unaffected). The failed step's blocks leave the
        prefix cache first: a later prompt must not reuse KV that was never written. A request that
        hit, in this step, blocks of one that then fails alone computes those blocks itself.

        :returns: logits, the ``scheduled`` index of each logits row, and the scheduled sequences
            that ran; None when none did.
        """
        scheduled = out.scheduled
        batch, rows = build_forward_batch(scheduled, self.allocator, out.finished_seq_ids)
        try:
            return self.runner.execute_model(batch), rows, scheduled
        except FatalError:
            raise
        except Exception as exc:  # noqa: BLE001 - isolated below, reported per request
            first_error = exc
        # The step's new KV was not (fully) written: its blocks must not serve prefix-cache hits.
        for item in scheduled:
            self.allocator.forget_uncomputed(item.seq.seq_id, item.start)
        requests = list(dict.fromkeys(item.seq.request for item in scheduled))
        if len(requests) == 1:
            self._fail(requests[0], _forward_error(first_error), outputs)
            return None
        kept: list[ScheduledSequence] = []
        parts: list[torch.Tensor] = []
        unwritten: set[int] = set()  # blocks whose new KV a failed request never wrote
        for request in requests:
            mine = [self._recompute_unwritten(item, unwritten) for item in scheduled if item.seq.request is request]
            try:
                batch, _ = build_forward_batch(mine, self.allocator, out.finished_seq_ids)
                logits = self.runner.execute_model(batch)
            except FatalError:
                raise
            except Exception as exc:  # noqa: BLE001
                for item in mine:  # before _fail frees them
                    unwritten.update(self._blocks_written_by(item))
                self._fail(request, _forward_error(exc), outputs)
                continue
            kept += mine
            parts.append(logits)
        if not kept:
            return None
        return torch.cat(parts), build_forward_batch(kept, self.allocator)[1], kept

    def _blocks_written_by(self, item: ScheduledSequence) -> list[int]:
        """The cache blocks holding the tokens ``item`` computes."""
        size = self.allocator.block_size
        table = self.allocator.block_table(item.seq.seq_id)
        return table[item.start // size:-(-(item.start + item.num_new_tokens) // size)]

    def _recompute_unwritten(self, item: ScheduledSequence, unwritten: set[int]) -> ScheduledSequence:
        """``item``, starting earlier if its cached prefix includes a block in ``unwritten``: a
        prefix-cache hit, in this step, on blocks of a request that then failed alone. Recomputing
        from that block writes the same keys/values the failed request would have (same tokens,
        same positions) instead of reading slots nobody wrote."""
        if not unwritten:
            return item
        size = self.allocator.block_size
        table = self.allocator.block_table(item.seq.seq_id)
        for index in range(-(-item.start // size)):
            if table[index] in unwritten:
                start = index * size
                return ScheduledSequence(item.seq, start, item.num_new_tokens + item.start - start)
        return item

    def _sample_and_append(self, logits: torch.Tensor, seqs: list[Sequence], changed: dict[str, Request]) -> None:
        if not seqs:
            return  # only intermediate prefill chunks ran
        row_of: list[int] = []
        targets: list[Sequence] = []
        for row, seq in enumerate(seqs):
            targets.append(seq)
            row_of.append(row)
            request = seq.request
            if not request.forked:
                if request.params.n > 1:
                    for child in self._fork(seq):
                        targets.append(child)
                        row_of.append(row)
                request.forked = True
        if len(targets) != logits.shape[0]:
            logits = logits[torch.tensor(row_of)]
        self._suppress_stop_tokens(logits, targets)
        metadata = SamplingMetadata.from_rows(
            [s.params.temperature for s in targets],
            [s.params.top_k for s in targets],
            [s.params.top_p for s in targets],
            [s.generator for s in targets],
        )
        tokens = self.sampler(logits, metadata).tolist()
        for seq, token in zip(targets, tokens):
            finish = self.stop_checker.append_token(seq, token)
            if finish is not None:
                self.scheduler.finish(seq, *finish)
            changed[seq.request.request_id] = seq.request

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Create completions 1 … n-1 sharing the parent's freshly prefilled prompt blocks."""
        children = []
        for index in range(1, parent.request.params.n):
            child = parent.fork(next(self._seq_ids), index)
            parent.request.seqs.append(child)
            children.append(child)
            if self._shares_kv_on_fork:
                try:
                    self.runner.copy_blocks(self.allocator.fork(parent.seq_id, child.seq_id))
                    self.scheduler.add_running(child)
                    continue
                except KVCacheError:
                    pass
            # No shared KV (model keeps its own cache, or no blocks): compute the child from scratch.
            child.reset_for_recompute()
            self.scheduler.waiting.appendleft(child)
        return children

    def _suppress_stop_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Below ``min_tokens``, EOS and stop token ids cannot be sampled."""
        for row, seq in enumerate(seqs):
            params = seq.params
            if params.min_tokens and seq.num_output_tokens < params.min_tokens:
                banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
                banned = [t for t in banned if t < logits.shape[1]]
                if banned:
                    logits[row, banned] = float("-inf")

    def _fail(self, request: Request, reason: str, outputs: list[RequestOutput]) -> None:
        logger.warning("request %r failed: %s", request.request_id, reason)
        request.error = reason
        request.forked = True
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")
        if self._requests.pop(request.request_id, None) is not None:
            outputs.append(self._output(request))

    def _output(self, request: Request) -> RequestOutput:
        completions = []
        for seq in request.seqs:
            delta = text_delta(seq)
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
        )

    # -- conveniences ----------------------------------------------------------------------------

    def new_request_id(self) -> str:
        """A fresh id for callers that do not name their requests."""
        while True:
            rid = f"auto-{next(self._auto_ids)}"
            if rid not in self._requests:
                return rid

    def run_until_finished(self, request_ids: Iterable[str], on_finished: Any = None) -> dict[str, RequestOutput]:
        """Step until every request in ``request_ids`` finished; return their final outputs.

        :param on_finished: called with each final output as it arrives (e.g. to advance a progress bar).
        """
        wanted = set(request_ids)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(wanted):
            if not self._requests and not self._pending:
                missing = sorted(wanted - set(done))
                raise RuntimeError(f"requests {missing} are not in the engine (aborted elsewhere?)")
            for output in self.step():
                if output.finished and output.request_id in wanted:
                    done[output.request_id] = output
                    if on_finished is not None:
                        on_finished(output)
        return done

    def generate_token_ids(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Generate for each token-id prompt and return the first completion's token ids, in order."""
        ids = [self.new_request_id() for _ in prompts]
        for rid, prompt in zip(ids, prompts):
            self.add_request(rid, prompt, params)
        done = self.run_until_finished(ids)
        return [done[rid].outputs[0].token_ids for rid in ids]

    def memory_stats(self) -> dict[str, Any]:
        """The runner's KV-cache statistics plus the engine's queue lengths."""
        stats = dict(self.runner.memory_stats())
        stats["num_waiting_seqs"] = len(self.scheduler.waiting)
        stats["num_running_seqs"] = len(self.scheduler.running)
        stats["num_preemptions"] = self.scheduler.num_preemptions
        return stats


def _forward_error(exc: Exception) -> str:
    return f"model forward failed: {type(exc).__name__}: {exc}"
