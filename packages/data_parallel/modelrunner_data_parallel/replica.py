"""One data-parallel replica: a whole engine (an :class:`~modelrunner.LLM`, itself possibly a tensor ×
pipeline group) in a process of its own, driven by the front over one connection.

``python -m modelrunner_data_parallel.replica`` reads its orders from stdin (as a tensor-parallel
worker does), loads the model, connects to the front's listener and says ``ready`` (with what the
front needs to serve without a model: the tokenizer, sizes, sampling defaults). Then it runs the
front's commands on its :class:`~modelrunner.engine.loop.EngineLoop` and sends back every output and,
every :data:`HEARTBEAT_S`, its loop's snapshot — the heartbeat by which the front tells a hung replica.
It leaves when the front says ``stop``, when the connection ends (the front is gone) or when its engine
loop dies (it says why first).

Messages (tuples of :mod:`modelrunner.wire` data over a :class:`~modelrunner.channel.Channel`;
nothing is pickled, and a replica only talks to a front that holds the deployment's secret):

- front → replica: ``("add", rid, prompt, params, extra, lora_request)``, ``("abort", rid)``,
  ``("abort_all",)``, ``("call", token, name, args)`` for ``stats`` / ``memory_stats`` /
  ``reset_prefix_cache`` (the LLM's) and ``add_lora`` / ``remove_lora`` (the engine's), ``("stop",)``.
- replica → front: ``("hello", rank, pid)``, ``("ready", info)`` (its tokenizer as files), ``("failed", message)``,
  ``("added", rid, error)``,
  ``("out", rid, output)``, ``("snap", snapshot)``, ``("result", token, value, error)``, ``("dead", message)``.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import traceback
from typing import Any

# The kernel's authenticated channel and wire format (internal: modelrunner.channel, modelrunner.wire).
from .channel import Channel, connect
from modelrunner.wire import WireError
from modelrunner_executor_mp.processes import die_with_parent, read_orders  # how a started child begins

from .protocol import CALLS, ENGINE_CALLS, HEARTBEAT_S, ReplicaOrders, tokenizer_files

logger = logging.getLogger("modelrunner.data_parallel")

class _Link:
    """The connection to the front, safe to send on from several threads."""

    def __init__(self, conn: Channel) -> None:
        self.conn = conn
        self._lock = threading.Lock()
        self.closed = False

    def send(self, message: tuple) -> None:
        if self.closed:
            return
        try:
            with self._lock:
                self.conn.send(message)
        except WireError as e:
            if message[0] == "result":  # the caller waits for an answer: the error is one
                self.send(("result", message[1], None, ("other", str(e))))
            else:
                logger.error("a replica message could not be sent: %s", e)
        except (OSError, EOFError, ValueError):
            self.closed = True  # the front is gone: the receiving thread notices too


def _describe(llm: Any) -> dict[str, Any]:
    """What the front needs to serve this model without loading it."""
    # What a front end needs of a loaded model, as the server describes it (internal: modelrunner.model_info).
    from modelrunner.model_info import describe_model

    model = describe_model(llm)
    return {"pid": os.getpid(), "host": socket.gethostname(), "tokenizer": tokenizer_files(model.tokenizer),
            "max_model_len": model.max_model_len, "root": model.root, "defaults": model.defaults,
            "image_token": model.image_token, "vocab_size": llm.engine.vocab_size,
            "max_num_seqs": llm.engine.config.scheduler.max_num_seqs}


def serve_front(orders: ReplicaOrders) -> int:
    """Load, connect, serve the front's commands; the exit status."""
    from modelrunner import LLM
    # The engine loop a replica runs, and the kernel's one-line errors (internal: modelrunner.engine.loop,
    # modelrunner.errors).
    from modelrunner.engine.loop import EngineLoop
    from modelrunner.errors import error_line

    conn = connect(tuple(orders.address), orders.authkey)
    link = _Link(conn)
    link.send(("hello", orders.rank, os.getpid()))
    try:
        llm = LLM.from_config(orders.config)
    except Exception as e:  # noqa: BLE001 - told to the front in one line
        link.send(("failed", error_line(e, hint=False)))
        return 2
    loop = EngineLoop(llm.engine).start()
    try:
        link.send(("ready", _describe(llm)))
        stop = threading.Event()

        def heartbeat() -> None:
            while not stop.wait(HEARTBEAT_S) and not link.closed:
                link.send(("snap", loop.snapshot))
                if loop.error is not None:
                    link.send(("dead", f"{type(loop.error).__name__}: {loop.error}"))
                    stop.set()

        threading.Thread(target=heartbeat, name="modelrunner-dp-heartbeat", daemon=True).start()
        _serve_commands(conn, link, loop, llm, stop)
        stop.set()
        loop.stop(0.0)
        return 0 if loop.error is None else 1
    finally:
        llm.shutdown()


def _serve_commands(conn: Channel, link: _Link, loop: Any, llm: Any, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            if not conn.poll(0.2):
                continue
            message = conn.recv()
        except (EOFError, OSError):
            return  # the front is gone (or sent what is not a message: then it is not ours)
        if not isinstance(message, (list, tuple)) or not message:
            logger.error("the front sent a malformed message; leaving")
            return
        kind = message[0]
        if kind == "stop":
            return
        try:
            if kind == "add":
                _, rid, prompt, params, extra, lora = message
                future = loop.add_request(rid, prompt, params, extra, lora_request=lora,
                                          on_output=lambda out, rid=rid: link.send(("out", rid, out)))
                future.add_done_callback(lambda f, rid=rid: link.send(("added", rid, _error_of(f))))
            elif kind == "abort":
                loop.abort_request(message[1])
            elif kind == "abort_all":
                loop.abort_all()
            elif kind == "call":
                _, token, name, args = message
                if name in CALLS:
                    call = lambda engine, name=name: getattr(llm, name)()  # noqa: E731
                elif name in ENGINE_CALLS:
                    call = lambda engine, name=name, args=args: getattr(engine, name)(*args)  # noqa: E731
                else:
                    link.send(("result", token, None, ("value", f"unknown call {name!r}")))
                    continue
                loop.call(call).add_done_callback(
                    lambda f, token=token: link.send(("result", token, None if f.exception() else f.result(),
                                                      _error_of(f))))
        except Exception as e:  # noqa: BLE001 - the loop is dead: the heartbeat says so
            logger.debug("replica command %s failed: %s", kind, e)


def _error_of(future: Any) -> tuple[str, str] | None:
    """``(kind, message)`` of a failed command: ``value`` for the engine's ``ValueError`` (a bad
    request), ``dead`` for a stopped engine loop, ``other`` for anything else; None if it succeeded."""
    from modelrunner.engine.loop import EngineDeadError  # internal, as above

    exc = future.exception()
    if exc is None:
        return None
    kind = "value" if isinstance(exc, ValueError) else "dead" if isinstance(exc, EngineDeadError) else "other"
    return kind, str(exc) if kind != "other" else f"{type(exc).__name__}: {exc}"


def main() -> None:
    """``python -m modelrunner_data_parallel.replica``: read its :class:`ReplicaOrders` from stdin (wire
    data, :func:`modelrunner_executor_mp.processes.read_orders`) and serve the front until it stops this
    replica or goes away."""
    orders: ReplicaOrders = read_orders()
    die_with_parent(orders.parent_pid)  # as a tensor-parallel worker dies with rank 0
    try:
        status = serve_front(orders)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # as a worker does: gloo's threads can abort interpreter teardown


if __name__ == "__main__":
    main()
