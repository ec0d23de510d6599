"""The engine loop as the HTTP handlers see it: submit a request's prompts, await their outputs.

Handlers never touch the engine: :meth:`AsyncEngine.generate` hands the prompts to the
:class:`~modelrunner.engine.loop.EngineLoop` and returns a :class:`Generation` whose outputs arrive
from the loop's thread through ``call_soon_threadsafe`` into the handler's own asyncio queue.
Closing a generation (the response ended, the client went away, the handler raised) aborts what
is still running, so its KV blocks are freed at the engine's next iteration.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from ..engine.loop import EngineDeadError, EngineLoop
from ..engine.outputs import RequestOutput
from ..sampling.params import SamplingParams
from .metrics import RequestTracker, ServerMetrics

RETRY_AFTER_S = 1
"""What ``Retry-After`` tells an overloaded server's clients."""


class Overloaded(Exception):
    """More requests in flight than the engine runs plus the waiting queue holds."""


class EngineStopped(Exception):
    """The engine loop stopped after a fatal error, or is shut down; the message says why."""


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
    """

    def __init__(self, loop: EngineLoop, max_running: int, max_waiting: int, metrics: ServerMetrics) -> None:
        self.loop = loop
        """The engine loop (its ``snapshot`` and ``error`` are read by /metrics and /health)."""
        self.max_in_flight = max_running + max_waiting
        """Most engine requests admitted at once."""
        self.metrics = metrics
        self.in_flight = 0
        """Engine requests admitted and not yet finished (or given up by their handler)."""

    def check_alive(self) -> None:
        """:raises EngineStopped: the loop stopped (after a fatal error, or shut down)."""
        if self.loop.error is not None:
            raise EngineStopped(f"the engine stopped after a fatal error: {type(self.loop.error).__name__}: "
                                f"{self.loop.error}")
        if not self.loop.running:
            raise EngineStopped("the engine loop is shut down")

    async def generate(self, request_id: str, prompts: list[Any], params: SamplingParams) -> Generation:
        """Queue one engine request per prompt (ids ``{request_id}-{index}``) and return their outputs.

        :raises Overloaded: admitting them would exceed :attr:`max_in_flight`.
        :raises PromptRejected: the engine refused a prompt (the others are aborted then).
        :raises EngineStopped: the engine is not running.
        """
        self.check_alive()
        if self.in_flight + len(prompts) > self.max_in_flight:
            raise Overloaded(f"the server has {self.in_flight} requests in flight and admits at most "
                             f"{self.max_in_flight} (max_num_seqs + max_waiting_requests); retry later")
        generation = Generation(self, [f"{request_id}-{i}" for i in range(len(prompts))])
        futures = []
        try:
            for index, prompt in enumerate(prompts):
                futures.append(self.loop.add_request(generation.ids[index], prompt, params,
                                                     on_output=generation.consumer(index)))
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
            self.loop.call(lambda engine: [engine.abort_request(r) for r in engine.unfinished_request_ids()])
        except EngineDeadError:
            pass


class Generation:
    """The engine requests of one HTTP request: their outputs in arrival order, as ``(prompt index,
    output)``, until every one finished. Use it as an async iterator; :meth:`close` it when done."""

    def __init__(self, engine: AsyncEngine, ids: list[str]) -> None:
        self.engine = engine
        self.ids = ids
        """Engine request id of each prompt."""
        self.finals: dict[int, RequestOutput] = {}
        """Prompt index → its finished output (filled as they arrive)."""
        self._queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self._aio = asyncio.get_running_loop()
        self._admitted: set[int] = set()
        self._trackers: dict[int, RequestTracker] = {}
        self._closed = False

    def admitted(self, index: int) -> None:
        """Count prompt ``index`` as in flight (it was handed to the loop)."""
        self._admitted.add(index)
        self.engine.in_flight += 1

    def consumer(self, index: int) -> Any:
        """The ``on_output`` of prompt ``index``: called in the loop's thread, hands over to ours."""
        call_soon = self._aio.call_soon_threadsafe
        deliver = self._deliver

        def on_output(output: RequestOutput) -> None:
            try:
                call_soon(deliver, index, output)
            except RuntimeError:  # the event loop is closed (the server is gone): nobody waits for it
                pass

        return on_output

    def _deliver(self, index: int, output: RequestOutput) -> None:
        tracker = self._trackers.get(index)
        if tracker is None:
            tracker = self._trackers[index] = self.engine.metrics.tracker()
        tracker.observe(output)
        if output.finished:
            self.finals[index] = output
            self._release(index)
        if not self._closed:
            self._queue.put_nowait((index, output))

    def _release(self, index: int) -> None:
        if index in self._admitted:
            self._admitted.discard(index)
            self.engine.in_flight -= 1

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        seen_final = 0
        while seen_final < len(self.ids):
            index, output = await self._queue.get()
            if output.finished:
                seen_final += 1
            yield index, output

    def close(self) -> None:
        """Abort every prompt still running and stop counting them in flight (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for index in list(self._admitted):
            if index not in self.finals:
                self.engine.abort(self.ids[index])
            self._release(index)
