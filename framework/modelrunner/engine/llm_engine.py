"""LLMEngine: requests in, one batched step at a time, outputs out (vLLM's ``add_request`` / ``step``).

The engine owns the scheduling state: its :class:`~.scheduler.Scheduler` owns the KV block
allocator (created here through the allocator plugin, for the block count the executor reports).
Each step is atomic for every request in it: a request either advances (its computed tokens and
its new token together) or, when its forward or its sampling fails, is retried alone once and fails
by itself with ``finish_reason="error"`` if it fails again — the others continue.

Outputs go to each request's consumer (the ``on_output`` of :meth:`LLMEngine.add_request`); those
of requests without one are kept until :meth:`LLMEngine.step` returns them. So several callers
(``LLM.generate``, a server, code stepping ``llm.llm_engine`` directly) share one engine loop
without losing each other's outputs.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import torch

from ..config import RunnerConfig
from ..executor import Executor, UniprocExecutor, create_executor
from ..lora import LoRARequest
from ..pooling.outputs import PoolingRequestOutput
from ..pooling.params import PoolingParams
from ..runner import ModelRunner
from ..sampling.chooser import TokenChooser
from ..sampling.logits_processor import ProcessorContext
from ..sampling.params import SamplingParams
from ..sampling.processors import ProcessorPipeline
from ..sampling.sampler import Sampler
from ..plugins import feature_class
from ..spec_decode import SPECULATIVE_DIST, SPECULATOR_GROUP
from ..structured_output.backend import GrammarContext
from ..structured_output.cursors import ConstrainedSequences
from ..structured_output.manager import StructuredOutputManager
from .detokenizer import start_detokenizer
from .forward import BatchForward
from .input_processor import InputProcessor
from .outputs import RequestMetrics, RequestOutput
from .pooling import EnginePooler
from .reporting import memory_stats, request_output
from .scheduler import Scheduler
from .sequence import Request, Sequence
from .step_update import StepUpdate
from .stop_checker import StopChecker

logger = logging.getLogger(__name__)

OutputConsumer = Callable[[RequestOutput], None]
"""Receives a request's outputs as steps produce them (the last one has ``finished=True``)."""


def as_executor(target: Executor | ModelRunner | RunnerConfig | dict[str, Any]) -> Executor:
    """An executor for ``target``: itself, a runner wrapped in one process, or one built from a config."""
    if isinstance(target, Executor):
        return target
    if isinstance(target, ModelRunner):
        return UniprocExecutor(runner=target)
    if isinstance(target, (RunnerConfig, dict)):
        return create_executor(target)
    raise TypeError(f"LLMEngine needs an Executor, a ModelRunner or a config, got {type(target).__name__}")


class LLMEngine:
    """Continuous batching over one loaded executor.

    ``add_request`` validates and queues a request (a bad one raises ``ValueError`` and leaves
    nothing behind); each step schedules, runs one forward over the flattened batch, applies the
    logits processors and samples every finished row at once, and reports every request that changed.

    :param executor: what runs the model: an :class:`~modelrunner.executor.Executor`, a
        :class:`~modelrunner.runner.ModelRunner` (run in this process) or a configuration.
    """

    def __init__(self, executor: Executor | ModelRunner | RunnerConfig | dict[str, Any]) -> None:
        executor = as_executor(executor)
        executor.load_model()
        self.executor = executor
        """Runs the model (one process or several)."""
        config = executor.config
        self.config: RunnerConfig = config
        """The whole configuration."""
        self.tokenizer = executor.tokenizer
        """The checkpoint's tokenizer (None for a checkpoint without one: prompts must be token ids)."""
        self.max_model_len: int = executor.max_model_len
        """Longest sequence (prompt + output) accepted."""
        cache = config.cache
        if executor.kv_cache_spec is None:  # the model keeps its own cache: nothing to share
            cache = attrs.evolve(cache, enable_prefix_caching=False)
        allocator = executor.plugins.create_allocator(cache.kv_allocator, executor.num_blocks, executor.block_size,
                                                      self.max_model_len, cache)
        self.scheduler = Scheduler(config.scheduler, allocator,
                                   config.lora.max_loras if config.lora.enable_lora else None)
        """Waiting and running queues; owns the KV block allocator."""
        self.sampler = Sampler(seed=config.model.seed)
        """Batched sampler; its shared generator serves requests without a seed."""
        loaded = executor.loaded
        self.vocab_size: int = loaded.vocab_size
        """Valid token ids are ``0 … vocab_size - 1``."""
        self.eos_token_ids: frozenset[int] = loaded.eos_token_ids
        """Token ids that end a completion unless ``ignore_eos``."""
        self.processors = ProcessorPipeline(executor.plugins,
                                            ProcessorContext(self.vocab_size, self.tokenizer, self.eos_token_ids))
        """The logits processors (built-in and named) requests use."""
        self.input_processor = InputProcessor(
            self.tokenizer, self.vocab_size, self.max_model_len, allocator.num_blocks * allocator.block_size,
            config.scheduler.max_num_seqs, process_inputs=executor.process_inputs,
            processor_states=self.processors.states_for, limits=config.limits,
        )
        """Tokenizes and validates new requests."""
        self.stop_checker = StopChecker(self.tokenizer, self.eos_token_ids, self.max_model_len)
        """Appends sampled tokens and decides when sequences end."""
        self.structured_outputs = StructuredOutputManager(
            executor.plugins, config.structured_outputs, GrammarContext(self.tokenizer, self.vocab_size,
                                                                        self.eos_token_ids))
        """Grammar backends, compiled grammars and each step's token bitmask for structured outputs."""
        self.constrained = ConstrainedSequences(self.structured_outputs, self.scheduler)
        """Constrained sequences waiting for their grammar or first mask, and their grammar cursors."""
        self.chooser = TokenChooser(self.sampler, self.processors, self.structured_outputs, self.constrained.cursor,
                                    self.vocab_size, self.tokenizer)
        """Turns each step's logits into tokens (masks, processors, sampling, drafts, log-probabilities)."""
        self.pooler = EnginePooler(executor.plugins, config.pooling, loaded,
                                   getattr(getattr(executor, "runner", None), "source", None),
                                   config.scheduler.max_num_batched_tokens)
        """Embedding (pooling) requests: the rows each step keeps, and the pooling method."""
        self.forward = BatchForward(executor, allocator, self.pooler)
        """Runs the model over each step's batch (each request alone when the batch fails)."""
        self.speculator: Any = None
        """Speculative decoding (None: off; ``modelrunner-speculative``'s speculator): proposes tokens each
        step, verified in the same forward."""
        if config.speculative is not None:
            speculator = feature_class(SPECULATOR_GROUP, "speculator", SPECULATIVE_DIST, "speculative_config")
            self.speculator = speculator.create(config, executor, allocator, self.vocab_size, self.tokenizer)
            self.speculator.excluded = self.constrained.is_slow
            self.scheduler.speculator = self.speculator
        self.update = StepUpdate(self.scheduler, executor, self.chooser, self.stop_checker, self.constrained,
                                 self.pooler, self.speculator, self._fail, self.next_seq_id)
        """Advances each step's sequences from its logits (sampling, drafts, pooling, stop conditions)."""
        self._requests: dict[str, Request] = {}
        self._unclaimed: list[RequestOutput] = []
        self._consumers: dict[str, OutputConsumer] = {}
        self._pending: list[RequestOutput] = []
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._auto_ids = itertools.count()
        self.num_steps = 0
        """Steps run so far."""
        executor.attach_engine(self)  # its generate() and scratch sequences now run through this engine

    @property
    def allocator(self) -> Any:
        """The KV block allocator (owned by the scheduler)."""
        return self.scheduler.allocator

    # -- requests --------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict[str, Any],
        params: SamplingParams | PoolingParams | dict | None = None,
        extra: dict[str, Any] | None = None,
        on_output: OutputConsumer | None = None,
        lora_request: Any = None,
    ) -> None:
        """Validate and queue a request.

        :param prompt: text, token ids, or ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``
            whose other keys (e.g. ``"images"``) join ``extra``.
        :param params: sampling parameters (None: defaults; a dict is turned into SamplingParams), or
            :class:`~modelrunner.pooling.PoolingParams` for an embedding request: it computes the
            prompt, samples nothing and ends with one :class:`~modelrunner.pooling.PoolingRequestOutput`.
            The engine keeps a validated copy: changing ``params`` later does not affect the request.
        :param extra: adapter inputs passed to the model in ``ForwardBatch.extra``.
        :param on_output: receives this request's outputs as steps produce them; without one they
            are returned by :meth:`step`.
        :param lora_request: the :class:`~modelrunner.lora.LoRARequest` of the adapter to run with
            (None: the base model); read from disk the first time (:meth:`add_lora`).
        :raises ValueError: duplicate id, empty or too long prompt, token ids outside the
            vocabulary, invalid sampling parameters or logits processors; a
            :class:`~modelrunner.errors.StructuredOutputError` (a ValueError) for ``structured_outputs``
            the grammar backend cannot serve, naming the feature. Nothing is queued then.
        """
        request_id = str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use; ids must be unique among live requests")
        if lora_request is not None:
            self.add_lora(lora_request)
        pooling = None
        if isinstance(params, PoolingParams):
            p = self.input_processor.process(request_id, prompt, None, extra, pooling=params)
            pooling = self.pooler.start(params, len(p.token_ids))
        elif not self.pooler.causal:
            raise ValueError(f"request {request_id!r}: model {self.pooler.model_name!r} is an encoder (bidirectional "
                             "attention): it computes embeddings (LLM.embed, POST /v1/embeddings), not generations")
        else:
            p = self.input_processor.process(request_id, prompt, params, extra)
        extra_keys = p.extra_keys if lora_request is None else (*p.extra_keys, ("lora", lora_request.lora_int_id))
        if pooling is not None:
            extra_keys += self.pooler.prefix_cache_key(pooling, request_id)
        grammar = None
        if p.params.structured_outputs is not None:
            grammar = self.structured_outputs.prepare(p.params.structured_outputs)  # compiles off this thread
        request = Request(
            request_id=request_id, prompt=p.text, prompt_token_ids=p.token_ids, params=p.params,
            arrival=next(self._arrivals), metrics=RequestMetrics(arrival_time=time.monotonic()), extra=p.extra,
            extra_keys=extra_keys, processor_states=p.processor_states, lora_request=lora_request,
            prompt_logprobs=None if p.params.prompt_logprobs is None else [None] * len(p.token_ids),
            grammar=grammar, pooling=pooling,
        )
        seq = Sequence.first_of(request, next(self._seq_ids))
        start_detokenizer(seq)
        request.seqs.append(seq)
        self._requests[request_id] = request
        if on_output is not None:
            self._consumers[request_id] = on_output
        if grammar is None:
            self.scheduler.add(seq)
        else:
            self.constrained.add(seq)  # scheduled once its grammar compiled and its first mask is ready

    def add_lora(self, lora_request: Any) -> None:
        """Read and check a LoRA adapter so requests can use it (vLLM's ``add_lora``); done by
        :meth:`add_request` for an adapter it has not seen.

        :raises ValueError: not a :class:`~modelrunner.lora.LoRARequest`, LoRA not enabled, or a bad
            adapter (the message names the file and the problem).
        """
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a modelrunner.LoRARequest (or None), got "
                             f"{type(lora_request).__name__}")
        self.executor.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget a LoRA adapter (vLLM's ``remove_lora``); False when it was never added.

        :raises ValueError: requests that use it are waiting or running (unloading is refused until they finish).
        """
        using = [r.request_id for r in self._requests.values() if r.lora_int_id == lora_int_id]
        if using:
            raise ValueError(f"LoRA adapter {lora_int_id} is used by {len(using)} unfinished request(s) "
                             f"({', '.join(map(repr, using[:3]))}); unload it after they finish")
        return self.executor.remove_lora(lora_int_id)

    def list_loras(self) -> list[Any]:
        """The added LoRA adapters (:class:`~modelrunner.lora.LoRARequest`), by id."""
        lora = self.executor.runner.lora
        return [] if lora is None else [lora.requests[i] for i in sorted(lora.requests)]

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now; its blocks are freed and its consumer (or the next :meth:`step`) gets a
        final output with ``finish_reason="abort"``. Returns False for an unknown or finished id."""
        request = self._requests.pop(str(request_id), None)
        if request is None:
            return False
        self.constrained.release(request)
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        request.forked = True
        request.metrics.finished_time = time.monotonic()
        self._pending.append(self._output(request))
        return True

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        """Requests waiting or running."""
        return len(self._requests)

    def unfinished_request_ids(self) -> list[str]:
        """The ids of the requests that wait or run."""
        return list(self._requests)

    def has_undelivered_outputs(self) -> bool:
        """True when outputs (e.g. of aborted requests) wait for the next step to deliver them."""
        return bool(self._pending)

    def is_running(self, request_id: str) -> bool:
        """True while the request waits or runs."""
        return str(request_id) in self._requests

    def check_health(self) -> None:
        """Raise the executor's fatal error if it can no longer run steps (a parallel worker died,
        even while idle); cheap, so a loop may call it every iteration."""
        self.executor.check_health()

    # -- the step --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; return the outputs of every request without a consumer that changed since the
        last call (outputs of requests with one went to it).

        Each output carries the cumulative text and token ids plus the delta since the last
        report; finished requests appear once more with ``finished=True`` and are then forgotten.
        """
        self.advance()
        outputs, self._unclaimed = self._unclaimed, []
        return outputs

    @torch.inference_mode()
    def advance(self) -> None:
        """Run one scheduled step and deliver its outputs: to each request's consumer, or kept for
        :meth:`step` when it has none."""
        for output in self._run_step():
            consumer = (self._consumers.pop(output.request_id, None) if output.finished
                        else self._consumers.get(output.request_id))
            if consumer is None:
                self._unclaimed.append(output)
            else:
                consumer(output)

    def _run_step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        changed: dict[str, Request] = {}
        failed_grammars = self.constrained.admit_compiled()
        failed_grammars += self.constrained.collect_masks(changed, outputs_pending=bool(self._pending))
        out = self.scheduler.schedule()
        outputs, self._pending = self._pending, []
        for request, reason in failed_grammars:
            self._fail(request, reason, outputs)
        for seq, reason in out.failed:
            self._fail(seq.request, reason, outputs)
        for seq in out.ended:
            changed[seq.request.request_id] = seq.request
        if not out.is_empty:
            self.num_steps += 1
            now = time.monotonic()
            for item in out.scheduled:
                metrics = item.seq.request.metrics
                metrics.first_scheduled_time = metrics.first_scheduled_time or now
            if out.block_copies:
                self.executor.copy_blocks(out.block_copies)
            executed = self.forward.run(out, lambda request, reason: self._fail(request, reason, outputs))
            if executed is not None:
                self.update.apply(executed, changed, outputs, started)
            if self.speculator is not None:
                self.update.release_lookahead(out)
        self.constrained.advance()
        for request in changed.values():
            if request.request_id in self._requests:
                outputs.append(self._output(request))
                if request.is_finished:
                    del self._requests[request.request_id]
                    self.constrained.release(request)
        self.scheduler.drop_finished()
        return outputs

    def _fail(self, request: Request, reason: str, outputs: list[RequestOutput]) -> None:
        logger.warning("request %r failed: %s", request.request_id, reason)
        request.error = reason
        request.forked = True
        self.constrained.release(request)
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")
        request.metrics.finished_time = time.monotonic()
        if self._requests.pop(request.request_id, None) is not None:
            outputs.append(self._output(request))

    def _output(self, request: Request) -> RequestOutput | PoolingRequestOutput:
        if request.pooling is not None:
            return self.pooler.output(request)
        return request_output(request, self.stop_checker.longest_stop_string)

    # -- conveniences ----------------------------------------------------------------------------

    def next_seq_id(self) -> int:
        """A fresh sequence id (for callers that run sequences of their own on the allocator, e.g. beam search)."""
        return next(self._seq_ids)

    def new_request_id(self) -> str:
        """A fresh id for callers that do not name their requests."""
        while True:
            rid = f"auto-{next(self._auto_ids)}"
            if rid not in self._requests:
                return rid

    def run_until_finished(self, request_ids: Iterable[str], on_finished: Any = None) -> dict[str, RequestOutput]:
        """Step until every request in ``request_ids`` (added without a consumer) finished; return their
        final outputs. Their other outputs are dropped; those of other requests stay for :meth:`step`.

        :param on_finished: called with each final output as it arrives (e.g. to advance a progress bar).
        """
        wanted = set(request_ids)
        done: dict[str, RequestOutput] = {}
        while True:
            mine = [o for o in self._unclaimed if o.request_id in wanted]
            if mine:
                self._unclaimed = [o for o in self._unclaimed if o.request_id not in wanted]
                for output in mine:
                    if output.finished:
                        done[output.request_id] = output
                        if on_finished is not None:
                            on_finished(output)
            missing = wanted - set(done)
            if not missing:
                return done
            if not any(rid in self._requests for rid in missing) and not self._pending:
                raise RuntimeError(f"requests {sorted(missing)} are not in the engine (aborted elsewhere?)")
            self.advance()

    def generate_token_ids(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Generate for each token-id prompt and return the first completion's token ids, in order."""
        ids = [self.new_request_id() for _ in prompts]
        results: dict[str, RequestOutput] = {}
        for rid, prompt in zip(ids, prompts):
            self.add_request(rid, prompt, params, on_output=self.collect(results))
        while len(results) < len(ids):
            self.advance()
        return [results[rid].outputs[0].token_ids for rid in ids]

    @staticmethod
    def collect(into: dict[str, RequestOutput]) -> OutputConsumer:
        """A consumer that keeps each request's final output in ``into`` (by request id)."""
        def consume(output: RequestOutput) -> None:
            if output.finished:
                into[output.request_id] = output
        return consume

    def memory_stats(self) -> dict[str, Any]:
        """The KV-cache pool's statistics (blocks used/free/cached, peak, prefix hits, fragmentation),
        its size in bytes, and the engine's queue lengths."""
        return memory_stats(self.allocator, self.scheduler, self.executor, self.config.cache.kv_allocator)

    def stats(self) -> dict[str, Any]:
        """Everything measured: ``kv_cache`` (:meth:`memory_stats`) plus the executor's ``model``,
        ``compile`` and (parallel) ``parallel`` sections, and ``structured_outputs`` once a request used them."""
        out = {"kv_cache": self.memory_stats(), **self.executor.stats()}
        if self.structured_outputs.used:
            out["structured_outputs"] = self.structured_outputs.stats()
        if self.speculator is not None:
            out["speculative"] = self.speculator.stats()
        return out

