"""One engine loop, many consumers: an :class:`LLMEngine` stepped by a thread of its own.

Other threads (an HTTP server's handlers, a benchmark's clients) never touch the engine: they hand
the loop commands — add a request (with the consumer its outputs go to), abort one, run a function
on the engine — and the loop runs them between steps, stepping continuously while any request is
unfinished and sleeping on its command queue otherwise. A request's outputs reach its consumer from
the loop's thread; consumers must be quick (e.g. ``loop.call_soon_threadsafe`` into an asyncio queue).

If a step raises an error the engine cannot recover from, or the engine reports itself unhealthy
between steps (a parallel worker died, noticed within a second even while idle), the loop stops:
every unfinished request's consumer receives a final output with ``finish_reason="error"``, later
commands fail with :class:`EngineDeadError`, and :attr:`EngineLoop.error` says why.

A step that does not end (a model or plugin call that blocks) cannot be interrupted, but it can be
seen: :meth:`EngineLoop.stuck_for` says how long the current step has run once that exceeds
``$MODELRUNNER_STEP_TIMEOUT`` (a server's ``/health`` then answers 503).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import attrs

from ..errors import ModelRunnerError
from ..plugin_timeout import timeout_from_env
from ..wire import register as _wire_type
from .llm_engine import LLMEngine, OutputConsumer
from .outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)


STEP_TIMEOUT_ENV = "MODELRUNNER_STEP_TIMEOUT"
"""Seconds one engine step may run before the loop reports itself stuck (default
:data:`DEFAULT_STEP_TIMEOUT_S`; ``0`` = never): see :meth:`EngineLoop.stuck_for`."""
DEFAULT_STEP_TIMEOUT_S = 60.0
"""The step bound when ``$MODELRUNNER_STEP_TIMEOUT`` is unset (a step runs at most
``max_num_batched_tokens`` tokens: seconds on a slow machine, not minutes)."""


class EngineDeadError(ModelRunnerError):
    """The engine loop stopped after a fatal error (or was shut down); no request can run."""


@_wire_type
@attrs.frozen
class LoopSnapshot:
    """The engine's state as of the loop's latest iteration (read from any thread without locking)."""

    num_running: int = 0
    """Sequences holding KV blocks."""
    num_waiting: int = 0
    """Sequences queued for blocks."""
    num_requests: int = 0
    """Unfinished requests."""
    kv_used_blocks: int = 0
    """KV-cache blocks in use."""
    kv_num_blocks: int = 0
    """KV-cache blocks in all."""
    prefix_queries: int = 0
    """Prompt tokens looked up in the prefix cache so far."""
    prefix_hits: int = 0
    """Of those, tokens found."""
    num_steps: int = 0
    """Steps run so far."""
    num_preemptions: int = 0
    """Sequences preempted so far."""
    spec_decode: Any = None
    """Speculative decoding's counts so far (a :class:`~modelrunner.spec_decode.SpecCounters`; None: off)."""

    @property
    def kv_usage(self) -> float:
        """Fraction of KV-cache blocks in use."""
        return self.kv_used_blocks / self.kv_num_blocks if self.kv_num_blocks else 0.0


class EngineLoop:
    """Steps ``engine`` in a background thread; every method is safe to call from any thread.

    :param engine: the engine the loop owns from now on (nobody else may call it).
    :param idle_wait_s: how long the loop sleeps on its command queue when there is nothing to do.
    """

    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.1) -> None:
        self.engine = engine
        """The engine (touch it only through :meth:`call`)."""
        self.idle_wait_s = idle_wait_s
        self.step_timeout_s = timeout_from_env(STEP_TIMEOUT_ENV, DEFAULT_STEP_TIMEOUT_S)
        """Seconds a step may run before :meth:`stuck_for` reports it (None: never)."""
        self._step_started: float | None = None
        self.error: BaseException | None = None
        """The fatal error that stopped the loop, when one did."""
        self.snapshot = LoopSnapshot()
        """The engine's state as of the latest iteration."""
        self._commands: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], Future]] = queue.SimpleQueue()
        self._consumers: dict[str, OutputConsumer] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="modelrunner-engine-loop", daemon=True)

    # -- control ---------------------------------------------------------------------------------

    def start(self) -> EngineLoop:
        """Start the loop's thread (idempotent); returns the loop."""
        if not self._thread.is_alive() and not self._stopping.is_set():
            self._thread.start()
        return self

    @property
    def running(self) -> bool:
        """True while the loop's thread runs and no fatal error stopped it."""
        return self._thread.is_alive() and self.error is None

    def stuck_for(self) -> float | None:
        """How long the step running now has run, once that exceeds :attr:`step_timeout_s`; None while
        steps end in time (or none runs)."""
        started = self._step_started
        if started is None or self.step_timeout_s is None:
            return None
        elapsed = time.monotonic() - started
        return elapsed if elapsed > self.step_timeout_s else None

    def stop(self, grace_s: float = 0.0) -> None:
        """Let unfinished requests run for up to ``grace_s`` seconds, abort the rest, and end the loop."""
        if not self._thread.is_alive():
            return
        deadline = time.monotonic() + grace_s
        while grace_s > 0 and time.monotonic() < deadline and self.snapshot.num_requests and self.error is None:
            time.sleep(0.02)
        try:
            self.abort_all().result(10)
            self.call(lambda engine: engine.advance() if engine.has_undelivered_outputs() else None).result(10)
        except Exception:  # noqa: BLE001 - a dead loop has nothing left to abort
            pass
        self._stopping.set()
        self._commands.put((lambda engine: None, Future()))  # wake it
        self._thread.join(10)

    # -- commands (any thread) --------------------------------------------------------------------

    def call(self, fn: Callable[[LLMEngine], Any]) -> Future:
        """Run ``fn(engine)`` in the loop's thread between steps; its result (or error) in the future.

        :raises EngineDeadError: the loop has stopped.
        """
        future: Future = Future()
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped after a fatal error: {self.error}")
        if self._stopping.is_set():
            raise EngineDeadError("the engine loop is shut down")
        self._commands.put((fn, future))
        return future

    def add_lora(self, lora_request: Any) -> Future:
        """Read an adapter into the engine (:meth:`LLMEngine.add_lora`) in the loop's thread."""
        return self.call(lambda engine: engine.add_lora(lora_request))

    def remove_lora(self, lora_int_id: int) -> Future:
        """Forget an adapter (:meth:`LLMEngine.remove_lora`) in the loop's thread."""
        return self.call(lambda engine: engine.remove_lora(lora_int_id))

    def add_request(self, request_id: str, prompt: Any, params: Any = None, extra: dict[str, Any] | None = None,
                    on_output: OutputConsumer | None = None, lora_request: Any = None) -> Future:
        """Queue a request (run with ``lora_request``, None: the base model); the future completes (or
        raises the engine's ``ValueError``) once the engine accepted it. Its outputs go to ``on_output``
        from the loop's thread."""
        def add(engine: LLMEngine) -> None:
            engine.add_request(request_id, prompt, params, extra, on_output=self._deliver(request_id),
                               lora_request=lora_request)
            if on_output is not None:
                self._consumers[request_id] = on_output

        return self.call(add)

    def abort_request(self, request_id: str) -> Future:
        """Abort a request (its consumer gets a final ``finish_reason="abort"`` output)."""
        return self.call(lambda engine: engine.abort_request(request_id))

    def abort_all(self) -> Future:
        """Abort every unfinished request (each consumer gets its final ``finish_reason="abort"`` output)."""
        return self.call(lambda engine: [engine.abort_request(rid) for rid in engine.unfinished_request_ids()])

    # -- the loop thread --------------------------------------------------------------------------

    def _deliver(self, request_id: str) -> OutputConsumer:
        def deliver(output: RequestOutput) -> None:
            consumer = self._consumers.pop(request_id, None) if output.finished else self._consumers.get(request_id)
            if consumer is None:
                return
            try:
                consumer(output)
            except Exception:  # noqa: BLE001 - a consumer's bug must not stop the loop for the others
                logger.exception("the consumer of request %r raised; aborting the request", request_id)
                self._consumers.pop(request_id, None)
                self.engine.abort_request(request_id)
        return deliver

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping.is_set():
                engine.check_health()  # a dead worker stops the loop even while idle
                busy = engine.has_unfinished_requests() or engine.has_undelivered_outputs()
                self._run_commands(block=not busy)
                if self._stopping.is_set():
                    break
                if engine.has_unfinished_requests() or engine.has_undelivered_outputs():
                    self._step_started = time.monotonic()
                    try:
                        engine.advance()
                    finally:
                        self._step_started = None
                self._snapshot()
        except BaseException as exc:  # noqa: BLE001 - fatal: fail every request and stop
            self.error = exc
            logger.error("engine loop stopped: %s: %s", type(exc).__name__, exc)
            self._fail_everything(exc)
        finally:
            self._snapshot()

    def _run_commands(self, block: bool) -> None:
        first = True
        while True:
            try:
                fn, future = self._commands.get(block=block and first, timeout=self.idle_wait_s)
            except queue.Empty:
                return
            first = False
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)

    def _snapshot(self) -> None:
        engine = self.engine
        stats = engine.allocator.stats()
        self.snapshot = LoopSnapshot(
            num_running=len(engine.scheduler.running), num_waiting=len(engine.scheduler.waiting),
            num_requests=engine.get_num_unfinished_requests(), kv_used_blocks=stats.used_blocks,
            kv_num_blocks=stats.num_blocks, prefix_queries=stats.prefix_queries, prefix_hits=stats.prefix_hits,
            num_steps=engine.num_steps, num_preemptions=engine.scheduler.num_preemptions,
            spec_decode=None if engine.speculator is None else attrs.evolve(engine.speculator.counters))

    def _fail_everything(self, exc: BaseException) -> None:
        message = f"the engine stopped: {type(exc).__name__}: {exc}"
        for request_id, consumer in list(self._consumers.items()):
            try:
                consumer(RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[],
                                       outputs=[CompletionOutput(index=0, text="", token_ids=[],
                                                                 finish_reason="error")],
                                       finished=True, error=message))
            except Exception:  # noqa: BLE001
                pass
        self._consumers.clear()
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                break
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError(message))
