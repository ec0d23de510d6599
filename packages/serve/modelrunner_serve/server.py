"""The server's life: bind, load the model in the background, serve, drain on a signal, shut down.

1. The socket is bound first (``--port 0`` picks a free port) and uvicorn starts serving at once,
   so ``/health`` answers 503 while the model loads; one line on stderr says where it listens.
2. A model-owner thread loads the model, starts the engine loop and then stays alive until
   shutdown: on Linux a tensor-parallel worker is killed when the *thread* that started it ends
   (``PR_SET_PDEATHSIG``), so the thread that loads the model must outlive serving.
3. On SIGINT/SIGTERM the server stops accepting connections, closes those still uploading a body,
   lets in-flight requests finish for up to the grace period, aborts the rest (their clients get
   ``finish_reason: "abort"``), waits for their responses to be sent, then stops the engine loop and
   the workers, and exits 0. A signal while the model is still loading exits at once: a load cannot
   be interrupted, so the process ends without waiting for it (workers die with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator

import prometheus_client
import uvicorn

from modelrunner.errors import DEBUG_ENV, error_line
from .app import build_app
from .async_engine import AsyncEngine
from .dp_metrics import ReplicaCollector
from .settings import ServeSettings
from .state import ServedModel, ServerState

# A child of the library's logger ("modelrunner", which _configure_logging sets up), not this module's path.
logger = logging.getLogger("modelrunner.serve")

SETTLE_S = 5.0
"""After the grace period: how long aborted requests get to send their last chunk."""
OWNER_JOIN_S = 60.0
"""How long shutdown waits for the model owner to shut a loaded model down."""
LOAD_ABANDON_S = 1.0
"""How long shutdown waits for a load still in progress before exiting without it."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one).

    :raises ValueError: the host does not resolve or the address cannot be bound (in use, no permission).
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} does not resolve to an address ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class ModelOwner(threading.Thread):
    """Loads the model, runs its engine loop while the server serves, and shuts both down.

    :param server: the server whose state it fills in and which it tells about the outcome.
    """

    def __init__(self, server: Server) -> None:
        super().__init__(name="modelrunner-model-owner", daemon=True)
        self.server = server
        self.load_done = threading.Event()
        """Set once loading ended, loaded or failed (until then the thread cannot be stopped)."""
        self._stop_requested = threading.Event()

    def run(self) -> None:
        """Load, serve until asked to stop, shut down (the LLM's workers included)."""
        settings, state = self.server.settings, self.server.state
        started = time.monotonic()
        try:
            from modelrunner.llm import LLM

            llm = LLM(settings.model, **settings.config)
        except Exception as e:
            self.load_done.set()
            if os.environ.get(DEBUG_ENV):
                logger.exception("loading the model failed")
            self.server.load_failed(error_line(e))
            return
        self.load_done.set()
        try:
            if self._stop_requested.is_set():
                return
            from modelrunner.engine.loop import EngineLoop
            from modelrunner_data_parallel import DataParallelLLM

            if isinstance(llm, DataParallelLLM):  # the replicas' loops run in their processes
                model, loop, max_running = ServedModel.from_replicas(llm), llm.router, llm.max_num_seqs
                state.adapters.start(llm.add_lora, settings.lora_modules)
                state.metrics.registry.register(ReplicaCollector(settings.model_name, llm.router.replicas))
                for r in llm.router.replicas:
                    print(f"modelrunner: data-parallel replica {r.rank} ready (pid {r.pid} on {r.info['host']})",
                          file=sys.stderr, flush=True)
            else:
                model = ServedModel.from_llm(llm)
                summary = llm.runner.stats().get("quantization", {}).get("summary")
                if summary:
                    print(f"modelrunner: {settings.model_name}: {summary}", file=sys.stderr, flush=True)
                state.adapters.start(llm.engine.add_lora, settings.lora_modules)
                loop = EngineLoop(llm.engine).start()
                max_running = llm.engine.config.scheduler.max_num_seqs
            engine = AsyncEngine(loop, max_running, settings.max_waiting_requests, state.metrics,
                                 max_stream_buffer=settings.max_stream_buffer)
            state.set_ready(model, engine)
            self.server.loaded(time.monotonic() - started)
            self._stop_requested.wait()
            loop.stop(0.0)
        except Exception as e:  # noqa: BLE001
            self.server.load_failed(error_line(e))
        finally:
            llm.shutdown()

    def stop(self, timeout: float, load_timeout: float = LOAD_ABANDON_S) -> bool:
        """Ask the owner to shut the model down and wait up to ``timeout`` seconds for it, or only
        ``load_timeout`` while the model is still loading; False if it is still loading then."""
        self._stop_requested.set()
        if self.is_alive() and not self.load_done.wait(load_timeout):
            return False
        self.join(timeout)
        return True


class _Uvicorn(uvicorn.Server):
    """uvicorn's server with this server's start-up line, drain and signal handling."""

    def __init__(self, config: uvicorn.Config, owner: Server) -> None:
        super().__init__(config)
        self.owner = owner

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGINT/SIGTERM start the shutdown (a second SIGINT forces it). Unlike uvicorn's own
        handling, the signal is not raised again afterwards: the process exits with status 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Start serving, then say so and start loading the model."""
        await super().startup(sockets=sockets)
        if self.started:
            self.owner.listening()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Stop accepting, drop half-uploaded requests, drain in-flight ones, then let uvicorn close
        the connections."""
        for server in getattr(self, "servers", []):
            server.close()
        self.owner.state.set_stopping()
        self.close_uploads()
        await self.owner.drain(self)
        await super().shutdown(sockets=sockets)

    def close_uploads(self) -> None:
        """Close the connections still sending a request body: nothing can be served to them any
        more, and uvicorn would otherwise wait for them and then cancel their handlers (logging a
        ``CancelledError`` traceback for each). Their handlers see an ordinary client disconnect."""
        for connection in list(self.server_state.connections):
            cycle = getattr(connection, "cycle", None)
            transport = getattr(connection, "transport", None)
            if (cycle is not None and transport is not None and getattr(cycle, "more_body", False)
                    and not getattr(cycle, "response_started", True)):
                transport.close()


class Server:
    """``modelrunner serve``: one model behind an OpenAI-compatible HTTP API.

    :param settings: what to serve and how.
    """

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.state = ServerState(settings)
        """What the handlers see."""
        self._sock: socket.socket | None = None
        self._uvicorn: _Uvicorn | None = None
        self._owner = ModelOwner(self)
        self.abandoned_load = False
        """True when :meth:`run` returned while the model was still loading (the process must then
        end without waiting for the loading thread: see :func:`serve`)."""

    def run(self) -> int:
        """Serve until SIGINT/SIGTERM; 0 after a clean shutdown, 2 when the model failed to load.

        :raises ValueError: the address cannot be bound.
        """
        settings = self.settings
        _configure_logging(settings.log_level)
        prometheus_client.disable_created_metrics()  # no *_created series (as vLLM); process-wide
        self._sock = bind_socket(settings.host, settings.port)
        config = uvicorn.Config(build_app(self.state), log_level=settings.log_level,
                                access_log=settings.log_level in ("debug", "info"), lifespan="off",
                                timeout_graceful_shutdown=int(SETTLE_S))
        self._uvicorn = _Uvicorn(config, self)
        try:
            self._uvicorn.run(sockets=[self._sock])
        finally:
            if not self._owner.stop(OWNER_JOIN_S):
                self.abandoned_load = True
                print("modelrunner: stopped while the model was loading; exiting without waiting for it",
                      file=sys.stderr, flush=True)
            elif self._owner.is_alive():
                logger.warning("the model did not shut down within %.0f s; exiting anyway", OWNER_JOIN_S)
        return 2 if self.state.phase == "failed" else 0

    # -- called by the uvicorn server and the model owner ------------------------------------------

    def listening(self) -> None:
        """uvicorn accepts connections: print where, and start loading the model."""
        assert self._sock is not None
        print(f"modelrunner: serving {self.settings.model_name} on {_url(self._sock)} (loading the model; "
              "GET /health answers 200 once ready)", file=sys.stderr, flush=True)
        self._owner.start()

    def loaded(self, seconds: float) -> None:
        """The model is loaded and the engine runs."""
        print(f"modelrunner: {self.settings.model_name} loaded in {seconds:.1f} s; ready", file=sys.stderr,
              flush=True)

    def load_failed(self, message: str) -> None:
        """The model could not be loaded: report it in one line and stop serving (exit status 2)."""
        self.state.set_failed(message)
        print(f"modelrunner: error: {message}", file=sys.stderr, flush=True)
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True

    async def drain(self, server: uvicorn.Server) -> None:
        """Let in-flight requests finish for up to the grace period, then abort the rest and give
        their responses :data:`SETTLE_S` seconds to go out."""
        self.state.set_stopping()
        engine = self.state.engine
        if engine is None:
            return
        grace = self.settings.grace_period_s
        deadline = time.monotonic() + grace
        while engine.in_flight and time.monotonic() < deadline and not server.force_exit:
            await asyncio.sleep(0.05)
        if engine.in_flight:
            logger.warning("aborting %d request(s) still running after the %g s grace period", engine.in_flight,
                           grace)
            engine.abort_all()
            settle = time.monotonic() + SETTLE_S
            while engine.in_flight and time.monotonic() < settle:
                await asyncio.sleep(0.02)


def _configure_logging(level: str) -> None:
    """Show the library's own warnings (failed requests, engine errors) on stderr at ``level``."""
    library = logging.getLogger("modelrunner")
    library.setLevel(level.upper())
    if not logging.getLogger().handlers and not any(isinstance(h, logging.StreamHandler) for h in library.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("modelrunner: %(levelname)s: %(message)s"))
        library.addHandler(handler)


def serve(settings: ServeSettings) -> int:
    """Run a server with ``settings`` until a shutdown signal; the process exit status.

    Stopped while the model was loading, it ends the process itself (``os._exit``): the loading
    thread cannot be interrupted, and interpreter shutdown around it could hang or crash.
    """
    server = Server(settings)
    status = server.run()
    if server.abandoned_load:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status

