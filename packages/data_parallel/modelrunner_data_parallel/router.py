"""The front's engine loop: the :class:`~modelrunner.engine.loop.EngineLoop` interface the server and
the offline API drive, over several replicas.

Each request goes to the live replica with the fewest requests in flight (its waiting + running,
counted here exactly as requests are sent and finish); a request whose prompt starts like a recent one
goes back to that one's replica (where its prefix is cached) unless that replica has more than
:data:`AFFINITY_SLACK` requests over the least loaded. Aborts go to the replica that runs the request.
A failed replica takes no new requests, nor does one whose heartbeat is late while another's is on
time (a stopped or stalled process: it is failed once silent for ``MODELRUNNER_DIST_TIMEOUT``); the
front serves while one replica lives. Nothing here blocks on a replica.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future
from typing import Any

import attrs

# The engine loop's interface the router offers, and its failure (internal: modelrunner.engine.loop).
from modelrunner.engine.loop import EngineDeadError, LoopSnapshot

from .client import ReplicaClient

AFFINITY_SLACK = 2
"""Extra requests in flight a replica may have over the least loaded one and still get a prompt whose prefix it holds."""
PREFIX_CHARS = 64
"""Characters of a text prompt (or ``block_size`` token ids) that make its prefix key."""
AFFINITY_ENTRIES = 4096
"""Prefix keys remembered (least recently used forgotten first)."""
STOP_JOIN_S = 10.0
"""How long replicas get to leave after being told to stop before they are killed."""


def prefix_key(prompt: Any, block_size: int) -> tuple | None:
    """What identifies a prompt's first KV block, cheaply: its first :data:`PREFIX_CHARS` characters or
    ``block_size`` token ids (None for a shorter prompt)."""
    if isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
        prompt = ids if ids is not None else prompt.get("prompt")
    if isinstance(prompt, str):
        return ("text", prompt[:PREFIX_CHARS]) if len(prompt) >= PREFIX_CHARS else None
    if isinstance(prompt, (list, tuple)) and len(prompt) >= block_size:
        return ("ids", tuple(prompt[:block_size]))
    return None


def total_snapshot(snapshots: list[LoopSnapshot]) -> LoopSnapshot:
    """The replicas' snapshots summed field by field (speculative decoding's counters too, where the
    replicas have them)."""
    total: dict[str, Any] = {}
    for field in attrs.fields(LoopSnapshot):
        values = [getattr(s, field.name) for s in snapshots]
        present = [v for v in values if v is not None]
        if field.name == "spec_decode":
            total[field.name] = _summed_counters(present) if present else None
        else:
            total[field.name] = sum(present)
    return LoopSnapshot(**total)


def _summed_counters(counters: list[Any]) -> Any:
    """attrs counter objects of one class summed field by field."""
    cls = type(counters[0])
    return cls(**{f.name: sum(getattr(c, f.name) for c in counters) for f in attrs.fields(cls)})


class DataParallelRouter:
    """Routes requests over ``replicas``; every method is safe to call from any thread.

    :param replicas: the ready replicas, by rank.
    :param block_size: KV block size (for prefix keys of token-id prompts).
    """

    def __init__(self, replicas: list[ReplicaClient], block_size: int) -> None:
        self.replicas = replicas
        """Every replica, failed ones included, by rank."""
        self.block_size = block_size
        self._routes: dict[str, ReplicaClient] = {}
        self._affinity: collections.OrderedDict[tuple, ReplicaClient] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._stopped = False
        self._turn = 0

    # -- the EngineLoop interface -----------------------------------------------------------------

    @property
    def snapshot(self) -> LoopSnapshot:
        """The live replicas' latest snapshots, summed."""
        return total_snapshot([r.snapshot for r in self.replicas if r.alive])

    @property
    def error(self) -> BaseException | None:
        """None while a replica lives; once every one failed, the first failure."""
        if any(r.alive for r in self.replicas) or self._stopped:
            return None
        return next((r.error for r in self.replicas if r.error is not None), None)

    @property
    def running(self) -> bool:
        """True until stopped or every replica failed."""
        return not self._stopped and any(r.alive for r in self.replicas)

    @property
    def failures(self) -> list[BaseException]:
        """Why each failed replica failed, by rank."""
        return [r.error for r in self.replicas if r.error is not None]

    def add_request(self, request_id: str, prompt: Any, params: Any = None, extra: dict[str, Any] | None = None,
                    on_output: Any = None, lora_request: Any = None) -> Future:
        """Send the request to the replica :meth:`choose` picks; the future completes once it accepted it.

        With a ``lora_request``, the replica reads the adapter the first time one of its requests uses
        it (or at :meth:`add_lora`).

        :raises EngineDeadError: stopped, or no replica lives.
        """
        replica = self.choose(prompt)

        def consume(output: Any) -> None:
            if output.finished:
                self._routes.pop(request_id, None)
            if on_output is not None:
                on_output(output)

        self._routes[request_id] = replica
        try:
            return replica.add_request(request_id, prompt, params, extra, on_output=consume,
                                       lora_request=lora_request)
        except BaseException:
            self._routes.pop(request_id, None)
            raise

    def choose(self, prompt: Any) -> ReplicaClient:
        """The live replica for ``prompt``: its prefix's replica if not too busy, else the least loaded
        (ties taken in turn).

        :raises EngineDeadError: stopped, or no replica lives.
        """
        if self._stopped:
            raise EngineDeadError("the engine loop is shut down")
        alive = [r for r in self.replicas if r.alive]
        if not alive:
            raise EngineDeadError(f"every data-parallel replica has failed: {self.failures[0]}")
        alive = [r for r in alive if r.responsive] or alive
        key = prefix_key(prompt, self.block_size)
        with self._lock:
            least = min(r.in_flight for r in alive)
            held = self._affinity.get(key) if key is not None else None
            if held is not None and held in alive and held.in_flight <= least + AFFINITY_SLACK:
                chosen = held
            else:
                n = len(self.replicas)
                chosen = min(alive, key=lambda r: (r.in_flight, (r.rank - self._turn) % n))
                self._turn = (chosen.rank + 1) % n
            if key is not None:
                self._affinity[key] = chosen
                self._affinity.move_to_end(key)
                if len(self._affinity) > AFFINITY_ENTRIES:
                    self._affinity.popitem(last=False)
        return chosen

    def add_lora(self, lora_request: Any) -> Future:
        """Read an adapter on every live replica (each serves it from its own memory); the future
        completes when all have, or fails with the first one's error (a ``ValueError`` naming what is
        wrong with the adapter)."""
        return _gather([r.call("add_lora", lora_request) for r in self.replicas if r.alive], lambda _: None)

    def remove_lora(self, lora_int_id: int) -> Future:
        """Forget an adapter on every live replica; the future's result: whether any had it (a
        ``ValueError`` while requests still use it there)."""
        return _gather([r.call("remove_lora", lora_int_id) for r in self.replicas if r.alive], any)

    def abort_request(self, request_id: str) -> Future:
        """Abort a request on the replica that runs it (its consumer gets a final ``abort`` output)."""
        replica = self._routes.get(request_id)
        if replica is not None:
            replica.abort_request(request_id)
        return _done()

    def abort_all(self) -> Future:
        """Abort every request on every live replica."""
        for replica in self.replicas:
            replica.abort_all()
        return _done()

    def stop(self, grace_s: float = 0.0) -> None:
        """Let requests run for up to ``grace_s`` seconds, abort the rest, stop every replica and wait
        for those started here to exit (killing them after :data:`STOP_JOIN_S`)."""
        if self._stopped:
            return
        deadline = time.monotonic() + grace_s
        while grace_s > 0 and time.monotonic() < deadline and any(r.in_flight for r in self.replicas if r.alive):
            time.sleep(0.02)
        self.abort_all()
        abort_deadline = time.monotonic() + 5.0
        while any(r.in_flight for r in self.replicas if r.alive) and time.monotonic() < abort_deadline:
            time.sleep(0.02)  # their final "abort" outputs reach the consumers
        self._stopped = True
        for replica in self.replicas:
            replica.stop()
        for replica in self.replicas:
            replica.join(STOP_JOIN_S)

    def kill(self) -> None:
        """Kill every replica started here at once (at exit, without asking)."""
        self._stopped = True
        for replica in self.replicas:
            replica.stop()
            replica.kill()


def _gather(futures: list[Future], combine: Any) -> Future:
    """One future for ``futures``: ``combine(results)`` once all are done, or the first error among them."""
    out: Future = Future()
    if not futures:
        out.set_result(combine([]))
        return out
    lock = threading.Lock()
    left = [len(futures)]

    def done(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        error = next((f.exception() for f in futures if f.exception() is not None), None)
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(combine([f.result() for f in futures]))

    for future in futures:
        future.add_done_callback(done)
    return out


def _done() -> Future:
    future: Future = Future()
    future.set_result(None)
    return future
