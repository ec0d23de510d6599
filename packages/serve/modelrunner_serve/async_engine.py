"""The engine loop as the HTTP handlers see it: submit a request's prompts, await their outputs.

Handlers never touch the engine: :meth:`AsyncEngine.generate` hands the prompts to the
:class:`~modelrunner.engine.loop.EngineLoop` and returns a :class:`Generation` whose outputs arrive
from the loop's thread through ``call_soon_threadsafe`` into the handler's own queue.
Closing a generation (the response ended, the client went away, the handler raised) aborts what
is still running, so its KV blocks are freed at the engine's next iteration.

The queue holds :class:`~.deltas.OutputDelta` (what each step added), and at most
``max_stream_buffer`` of them per prompt: a client that stops reading has its request aborted
there, and what still arrives is folded into the queued deltas, so memory stays bounded.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from modelrunner.engine.loop import EngineDeadError, EngineLoop
from modelrunner.engine.outputs import RequestOutput
from modelrunner.sampling.params import SamplingParams
from .deltas import OutputDelta, to_delta
from .metrics import ServerMetrics
from .settings import DEFAULT_MAX_STREAM_BUFFER

logger = logging.getLogger("modelrunner.serve")

RETRY_AFTER_S = 1
"""What ``Retry-After`` tells an overloaded server's clients."""


class Overloaded(Exception):
    """More requests in flight than the engine runs plus the waiting queue holds."""


class NeverFits(ValueError):
    """A request with more prompts than the engine can ever hold at once (retrying cannot help)."""


class EngineStopped(Exception):
    """The engine loop stopped after a fatal error, or is shut down; the message says why."""


class AdapterRetired(Exception):
    """The request named a LoRA adapter that was unloaded (and perhaps loaded again from another path)
    before the request reached the engine; the message names the adapter."""


class PromptRejected(ValueError):
    """The engine refused one of a request's prompts (its ``ValueError``); ``index`` says which."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


class AsyncEngine:
    """Admission control and output delivery in front of one engine loop.

    :param loop: the running engine loop.
    :param max_running: requests the engine runs at once (``max_num_seqs``).
    :param max_waiting: requests that may wait beyond those; more get :class:`Overloaded`.
    :param metrics: observes every output.
    :param max_stream_buffer: outputs per prompt that may wait for a client to read them; past
        that its request is aborted.
    """

    def __init__(self, loop: EngineLoop, max_running: int, max_waiting: int, metrics: ServerMetrics,
                 max_stream_buffer: int = DEFAULT_MAX_STREAM_BUFFER) -> None:
        self.loop = loop
        """The engine loop (its ``snapshot`` and ``error`` are read by /metrics and /health)."""
        self.max_in_flight = max_running + max_waiting
        """Most engine requests admitted at once."""
        self.metrics = metrics
        self.max_stream_buffer = max_stream_buffer
        """Outputs per prompt that may wait for the client (see :class:`Generation`)."""
        self.limits = f"max_num_seqs {max_running} + max_waiting_requests {max_waiting}"
        """Where :attr:`max_in_flight` comes from, for messages."""
        self.in_flight = 0
        """Engine requests admitted and not yet finished (or given up by their handler)."""
        self._retired_loras: set[int] = set()

    def retire_lora(self, lora_request: Any) -> None:
        """From now on refuse requests that run ``lora_request`` (its adapter is being unloaded): called
        on the event loop right before the removal is queued, so every request queued after the
        removal is refused and every one queued before it keeps the adapter busy."""
        self._retired_loras.add(lora_request.lora_int_id)

    def restore_lora(self, lora_request: Any) -> None:
        """Undo :meth:`retire_lora` (the unload was refused: the adapter serves on)."""
        self._retired_loras.discard(lora_request.lora_int_id)

    def check_alive(self) -> None:
        """:raises EngineStopped: the loop stopped (after a fatal error, or shut down)."""
        if self.loop.error is not None:
            raise EngineStopped(f"the engine stopped after a fatal error: {type(self.loop.error).__name__}: "
                                f"{self.loop.error}")
        if not self.loop.running:
            raise EngineStopped("the engine loop is shut down")

    async def generate(self, request_id: str, prompts: list[Any], params: SamplingParams,
                       stream: bool = True, lora_request: Any = None) -> Generation:
        """Queue one engine request per prompt (ids ``{request_id}-{index}``) and return their outputs.

        :param stream: the handler iterates over every step's delta (False: only the final outputs
            are queued; the handler reads :attr:`Generation.finals`).
        :param lora_request: the LoRA adapter every prompt runs with (None: the base model).
        :raises NeverFits: more prompts than :attr:`max_in_flight`, however idle the server.
        :raises Overloaded: admitting them now would exceed :attr:`max_in_flight`.
        :raises PromptRejected: the engine refused a prompt (the others are aborted then).
        :raises EngineStopped: the engine is not running.
        :raises AdapterRetired: ``lora_request``'s adapter was unloaded since the handler looked it up.
        """
        self.check_alive()
        if lora_request is not None and lora_request.lora_int_id in self._retired_loras:
            raise AdapterRetired(f"the LoRA adapter {lora_request.lora_name!r} this request named (read from "
                                 f"{lora_request.lora_path!r}) was unloaded before the request started; send it "
                                 f"again to run whatever {lora_request.lora_name!r} names now")
        if len(prompts) > self.max_in_flight:
            raise NeverFits(f"{len(prompts)} prompts can never be admitted at once; accepted: at most "
                            f"{self.max_in_flight} prompts per request ({self.limits})")
        if self.in_flight + len(prompts) > self.max_in_flight:
            raise Overloaded(f"the server has {self.in_flight} requests in flight and admits at most "
                             f"{self.max_in_flight} (max_num_seqs + max_waiting_requests); retry later")
        generation = Generation(self, [f"{request_id}-{i}" for i in range(len(prompts))], stream)
        futures = []
        try:
            for index, prompt in enumerate(prompts):
                futures.append(self.loop.add_request(generation.ids[index], prompt, params,
                                                     on_output=generation.consumer(index), lora_request=lora_request))
                generation.admitted(index)
            results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures), return_exceptions=True)
        except EngineDeadError as e:
            generation.close()
            raise EngineStopped(str(e)) from None
        except BaseException:
            generation.close()  # e.g. the client went away while the prompts were queued
            raise
        for index, result in enumerate(results):
            if isinstance(result, BaseException):
                generation.close()
                if isinstance(result, ValueError):
                    raise PromptRejected(index, str(result)) from None
                if isinstance(result, EngineDeadError):
                    raise EngineStopped(str(result)) from None
                raise result
        return generation

    def abort(self, request_id: str) -> None:
        """Abort one engine request (nothing happens if it already finished or the loop stopped)."""
        try:
            self.loop.abort_request(request_id)
        except EngineDeadError:
            pass

    def abort_all(self) -> None:
        """Abort every unfinished request (at shutdown, after the grace period)."""
        try:
            self.loop.abort_all()
        except EngineDeadError:
            pass


class Generation:
    """The engine requests of one HTTP request: their deltas in arrival order, as ``(prompt index,
    delta)``, until every one finished. Use it as an async iterator; :meth:`close` it when done.

    At most ``max_stream_buffer`` deltas per prompt wait in its queue. One more means the client
    stopped reading: the request is aborted (freeing its KV blocks) and whatever still arrives is
    folded into the newest queued delta of its prompt, so the client that reads again later gets
    everything up to the abort, in order.

    :param engine: the engine it was admitted by.
    :param ids: the engine request id of each prompt.
    :param stream: queue every step's delta (False: only the final ones).
    """

    def __init__(self, engine: AsyncEngine, ids: list[str], stream: bool = True) -> None:
        self.engine = engine
        self.ids = ids
        """Engine request id of each prompt."""
        self.stream = stream
        self.finals: dict[int, RequestOutput] = {}
        """Prompt index → its finished output, whole (filled as they arrive)."""
        self.capacity = engine.max_stream_buffer * len(ids)
        """Most deltas the queue holds before the request counts as unread and is aborted."""
        self.overflowed = False
        """True once the client fell :attr:`capacity` deltas behind (and the request was aborted)."""
        self._pending: deque[tuple[int, OutputDelta]] = deque()
        self._ready = asyncio.Event()
        self._aio = asyncio.get_running_loop()
        self._admitted: set[int] = set()
        self._closed = False

    @property
    def queued(self) -> int:
        """Deltas waiting for the handler."""
        return len(self._pending)

    def admitted(self, index: int) -> None:
        """Count prompt ``index`` as in flight (it was handed to the loop)."""
        self._admitted.add(index)
        self.engine.in_flight += 1

    def consumer(self, index: int) -> Any:
        """The ``on_output`` of prompt ``index``: called in the loop's thread, it observes the output's
        metrics, keeps its delta only (the whole output only when final), and hands over to ours."""
        call_soon = self._aio.call_soon_threadsafe
        deliver = self._deliver
        tracker = self.engine.metrics.tracker()
        first: list[OutputDelta] = []

        def on_output(output: RequestOutput) -> None:
            tracker.observe(output)
            if not (self.stream or output.finished):
                return
            delta = to_delta(output, first[0] if first else None)
            if not first:
                first.append(delta)
            try:
                call_soon(deliver, index, delta, output if output.finished else None)
            except RuntimeError:  # the event loop is closed (the server is gone): nobody waits for it
                pass

        return on_output

    def _deliver(self, index: int, delta: OutputDelta, final: RequestOutput | None) -> None:
        if final is not None:
            self.finals[index] = final
            self._release(index)
        if self._closed:
            return
        if len(self._pending) >= self.capacity:
            self._overflow(index, delta)
        else:
            self._pending.append((index, delta))
        self._ready.set()

    def _overflow(self, index: int, delta: OutputDelta) -> None:
        """The client stopped reading: abort (once) and fold ``delta`` into its prompt's newest one."""
        if not self.overflowed:
            self.overflowed = True
            logger.warning("aborting request %s: its client stopped reading (%d outputs waiting; "
                           "--max-stream-buffer %d)", self.ids[0].rsplit("-", 1)[0], len(self._pending),
                           self.engine.max_stream_buffer)
            for i, request_id in enumerate(self.ids):
                if i not in self.finals:
                    self.engine.abort(request_id)
        for queued_index, queued in reversed(self._pending):
            if queued_index == index:
                queued.absorb(delta)
                return
        self._pending.append((index, delta))  # at most once per prompt: later ones fold into it

    def _release(self, index: int) -> None:
        if index in self._admitted:
            self._admitted.discard(index)
            self.engine.in_flight -= 1

    def __aiter__(self) -> AsyncIterator[tuple[int, OutputDelta]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[int, OutputDelta]]:
        seen_final = 0
        while seen_final < len(self.ids):
            while not self._pending:
                self._ready.clear()
                await self._ready.wait()
            index, delta = self._pending.popleft()
            if delta.finished:
                seen_final += 1
            yield index, delta

    def close(self) -> None:
        """Abort every prompt still running and stop counting them in flight (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._pending.clear()
        for index in list(self._admitted):
            if index not in self.finals:
                self.engine.abort(self.ids[index])
            self._release(index)
