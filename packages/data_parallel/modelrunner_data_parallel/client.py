"""The front's end of one replica's connection: send it requests, hand its outputs to their consumers,
and notice when it dies or hangs.

A reader thread per replica receives everything the replica sends. A replica that ends (its
connection closes: killed, crashed) or whose engine loop stops is failed at once; one that sends
nothing — not even its :data:`~.protocol.HEARTBEAT_S` heartbeat — for ``MODELRUNNER_DIST_TIMEOUT``
seconds is failed as hung and killed. Failing a replica ends only its own requests (each consumer
gets a final output with ``finish_reason="error"`` naming the replica); nothing restarts it.

Sending never blocks the caller (the server's event loop): messages are encoded at once (so a
request that is not data fails at once) and written by a sender thread per replica, so a replica that
stopped reading (SIGSTOP, a full socket) holds up only its own queue. One whose heartbeat is late
(:data:`STALE_S`) gets no new requests while another answers.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import signal
import struct
import subprocess
import threading
import time
from concurrent.futures import Future
from typing import Any

from modelrunner import CompletionOutput, RequestOutput
from modelrunner.api import WorkerFailedError, collective_timeout
# Internal modules of the kernel: its authenticated channel and wire format (modelrunner.channel, .wire),
# the engine loop's interface and failure (modelrunner.engine.loop), and how a child process ended, as
# the executor says it (modelrunner.executor).
from modelrunner import wire
from .channel import Channel
from modelrunner.engine.loop import EngineDeadError, LoopSnapshot
from modelrunner_executor_mp import describe_exit

logger = logging.getLogger("modelrunner.data_parallel")

POLL_S = 0.2
"""How often the reader wakes to check for silence and process exits."""
EXIT_SETTLE_S = 1.0
"""After a replica's connection closes, how long to wait for its exit code (to say how it ended)."""
STALE_S = 1.0
"""A replica not heard from for this long (four heartbeats) gets no new requests while another answers."""


class ReplicaFailedError(WorkerFailedError):
    """A data-parallel replica died, hung or its engine stopped; its requests failed, the others go on.

    :param rank: the replica's data-parallel rank (:attr:`rank`).
    """

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message, rank, "serving")


class ReplicaClient:
    """One replica as the front sees it (built once the replica said ``ready``).

    :param rank: its data-parallel rank.
    :param conn: the connection it opened to the front's listener.
    :param info: what it said when ready (pid, host, tokenizer, sizes).
    :param process: its process, when this machine started it (None: a ``--headless`` machine's).
    """

    def __init__(self, rank: int, conn: Channel, info: dict[str, Any],
                 process: subprocess.Popen | None = None) -> None:
        self.rank = rank
        self.conn = conn
        self.info = info
        """What the replica reported when it was ready."""
        self.process = process
        self.pid: int = info["pid"]
        """The replica's process id (on its host)."""
        self.snapshot = LoopSnapshot()
        """Its engine loop's latest snapshot (from its heartbeat)."""
        self.error: ReplicaFailedError | None = None
        """Why it failed, once it has."""
        self.in_flight = 0
        """Requests sent to it and not yet finished: its load as the router counts it."""
        self.served = 0
        """Requests it finished (any finish reason)."""
        self._consumers: dict[str, Any] = {}
        self._adds: dict[str, Future] = {}
        self._calls: dict[int, Future] = {}
        self._tokens = itertools.count()
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._stopping = False
        self._last_heard = time.monotonic()
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, name=f"modelrunner-dp-replica-{rank}", daemon=True)
        self._reader.start()
        self._sender = threading.Thread(target=self._write, name=f"modelrunner-dp-send-{rank}", daemon=True)
        self._sender.start()

    def __repr__(self) -> str:
        return f"data-parallel replica {self.rank} (pid {self.pid} on {self.info.get('host', '?')})"

    @property
    def alive(self) -> bool:
        """True until it failed or was stopped."""
        return self.error is None and not self._stopping

    @property
    def responsive(self) -> bool:
        """Alive and heard from within :data:`STALE_S` (its heartbeat is on time)."""
        return self.alive and time.monotonic() - self._last_heard < STALE_S

    # -- commands (any thread) --------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Any, params: Any = None, extra: dict[str, Any] | None = None,
                    on_output: Any = None, lora_request: Any = None) -> Future:
        """Send a request (run with ``lora_request``, None: the base model); the future completes once
        the replica's engine accepted it (or raises its ``ValueError``). Its outputs go to
        ``on_output`` from the reader thread.

        :raises EngineDeadError: the replica has failed.
        """
        future: Future = Future()
        with self._lock:
            if self.error is not None:
                raise EngineDeadError(str(self.error))
            self._consumers[request_id] = on_output
            self._adds[request_id] = future
            self.in_flight += 1
        try:
            self._send(("add", request_id, prompt, params, extra, lora_request))
        except wire.WireError as e:  # nothing was sent
            self._settle(request_id)
            self._adds.pop(request_id, None)
            future.set_exception(ValueError(f"the request cannot be sent to a replica: {e}"))
        return future

    def abort_request(self, request_id: str) -> None:
        """Abort one of its requests (nothing happens if it finished or the replica failed)."""
        self._send_quietly(("abort", request_id))

    def abort_all(self) -> None:
        """Abort every request it runs."""
        self._send_quietly(("abort_all",))

    def call(self, name: str, *args: Any) -> Future:
        """Call the LLM method ``name`` (:data:`~.protocol.CALLS`) or engine method (``ENGINE_CALLS``,
        with ``args``) in the replica; its result in the future (a ``ValueError`` for a refused one)."""
        future: Future = Future()
        token = next(self._tokens)
        with self._lock:
            if self.error is not None:
                raise EngineDeadError(str(self.error))
            self._calls[token] = future
        self._send_quietly(("call", token, name, args))
        return future

    def stop(self) -> None:
        """Ask it to leave (its unfinished requests are dropped); :meth:`join` waits for it."""
        self._stopping = True
        self._send_quietly(("stop",))
        self._outbox.put(None)  # the sender leaves once "stop" is written

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a replica started here to exit, then kill it."""
        if self.process is not None:
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reader.join(timeout)

    def kill(self) -> None:
        """Kill a replica started here (with what it started) and reap it."""
        proc = self.process
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                pass

    def _send(self, message: tuple) -> None:
        """Queue ``message`` for the sender thread (never blocks).

        :raises wire.WireError: it is not data (nothing was queued).
        """
        data = wire.encode(message)
        self._outbox.put(struct.pack("!Q", len(data)) + data)

    def _send_quietly(self, message: tuple) -> None:
        if self.error is not None:
            return
        try:
            self._send(message)
        except wire.WireError as e:
            logger.error("%s: a message could not be encoded: %s", self, e)

    def _write(self) -> None:
        while True:
            frame = self._outbox.get()
            if frame is None or self.error is not None:
                return
            try:
                with self._send_lock:
                    self.conn.sock.sendall(frame)
            except OSError:
                return  # the reader notices the closed connection and fails the replica

    # -- the reader thread ------------------------------------------------------------------------

    def _read(self) -> None:
        timeout = collective_timeout()
        while self.error is None:
            try:
                ready = self.conn.poll(POLL_S)
                message = self.conn.recv() if ready else None
                if message is not None and (not isinstance(message, (list, tuple)) or not message):
                    raise OSError(f"it sent a malformed message {message!r:.80}")
            except (EOFError, OSError):
                if not self._stopping:
                    self.fail(self._how_it_ended())
                return
            now = time.monotonic()
            if message is None:
                if now - self._last_heard > timeout and not self._stopping:
                    self.fail(f"sent nothing for {timeout:g} s (MODELRUNNER_DIST_TIMEOUT): it hangs; killed it")
                    self.kill()
                continue
            self._last_heard = now
            self._handle(message)

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "out":
            _, request_id, output = message
            with self._lock:
                consumer = (self._consumers.pop(request_id, None) if output.finished
                            else self._consumers.get(request_id))
                if output.finished and consumer is not None:
                    self.in_flight -= 1
                    self.served += 1
            if consumer is not None:
                _call(consumer, output)
        elif kind == "snap":
            self.snapshot = message[1]
        elif kind == "added":
            _, request_id, error = message
            future = self._adds.pop(request_id, None)
            if error is not None:
                self._settle(request_id)
            if future is not None:
                if error is None:
                    future.set_result(None)
                else:
                    kind_, text = error
                    future.set_exception(ValueError(text) if kind_ == "value" else EngineDeadError(text))
        elif kind == "result":
            _, token, value, error = message
            future = self._calls.pop(token, None)
            if future is not None:
                if error is None:
                    future.set_result(value)
                else:
                    kind_, text = error
                    future.set_exception(ValueError(text) if kind_ == "value" else EngineDeadError(text))
        elif kind == "dead":
            self.fail(f"stopped: its engine failed ({message[1]})")

    def _settle(self, request_id: str) -> None:
        with self._lock:
            if self._consumers.pop(request_id, None) is not None:
                self.in_flight -= 1

    def _how_it_ended(self) -> str:
        proc = self.process
        if proc is None:
            return "closed its connection (its process or machine is gone)"
        deadline = time.monotonic() + EXIT_SETTLE_S
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return describe_exit(proc.returncode) if proc.returncode is not None else "closed its connection"

    def fail(self, reason: str) -> None:
        """Mark it failed (once): every request it runs ends with ``finish_reason="error"``, every
        pending command raises :class:`EngineDeadError`. Nothing restarts it."""
        with self._lock:
            if self.error is not None:
                return
            self.error = ReplicaFailedError(f"{self!r} {reason}", self.rank)
            consumers, self._consumers = self._consumers, {}
            adds, self._adds = self._adds, {}
            calls, self._calls = self._calls, {}
            self.in_flight = 0
        logger.error("%s; its %d request(s) failed, the other replicas go on serving (restart the server "
                     "to bring it back)", self.error, len(consumers))
        message = f"the engine stopped: {self.error}"
        for request_id, consumer in consumers.items():
            _call(consumer, RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[],
                                          outputs=[CompletionOutput(index=0, text="", token_ids=[],
                                                                    finish_reason="error")],
                                          finished=True, error=message))
        for future in [*adds.values(), *calls.values()]:
            if not future.done():
                future.set_exception(EngineDeadError(message))
        self._outbox.put(None)
        self.conn.close()


def _call(consumer: Any, output: RequestOutput) -> None:
    try:
        consumer(output)
    except Exception:  # noqa: BLE001 - a consumer's bug must not stop the reader for the others
        logger.exception("the consumer of request %r raised", output.request_id)
