"""The process ``bench compare`` runs per configuration, and the parent's handle on it.

Each configuration lives in its own interpreter (``python -m modelrunner_bench.worker``), so
nothing leaks between configurations: not compiled code, plugin registries, thread pools or
allocator state. The parent keeps every worker alive and asks them in turn for one repetition,
so the repetitions of different configurations interleave.

The protocol is one JSON object per line: the parent writes ``{"op": "load", "spec": {...}}``,
``{"op": "run", "keep_outputs": bool}`` or ``{"op": "exit"}`` to the worker's stdin; the worker
answers each of the first two with ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}`` on
its original stdout. Anything else the worker prints goes to its stderr.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from typing import IO, Any

# The kernel's one-line rendering of an error, as its CLI prints it (internal: no public equivalent).
from modelrunner.errors import error_line
from .session import BenchSession, BenchSpec


def serve(requests: IO[str], replies: IO[str]) -> None:
    """Answer the parent's requests until ``exit`` or the end of ``requests``."""
    session: BenchSession | None = None
    for line in requests:
        message = json.loads(line)
        op = message.get("op")
        if op == "exit":
            break
        try:
            if op == "load":
                session = BenchSession(BenchSpec.from_dict(message["spec"]))
                reply = {"ok": True, "info": session.load()}
            elif op == "run":
                if session is None:
                    raise RuntimeError("run before load")
                reply = {"ok": True, "sample": session.run(keep_outputs=bool(message.get("keep_outputs")))}
            else:
                raise ValueError(f"unknown worker request {op!r}")
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which carries on with the others
            reply = {"ok": False, "error": error_line(exc, hint=False)}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    if session is not None:
        session.close()


def main() -> int:
    """Worker entry point: keep the original stdout for replies, send everything else to stderr."""
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    serve(sys.stdin, replies)
    return 0


class WorkerError(RuntimeError):
    """A worker answered a request with an error, or died; the message says which and why."""


class WorkerProcess:
    """The parent's handle on one worker.

    :param spec: the configuration it loads.
    :param env: environment variables set for it on top of this process's environment.
    """

    def __init__(self, spec: BenchSpec, env: dict[str, str] | None = None) -> None:
        self.spec = spec
        """The configuration it runs."""
        full_env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        if spec.threads is not None:
            full_env["OMP_NUM_THREADS"] = str(spec.threads)
        # The worker's stderr (warnings, tracebacks) is kept to explain a crash, not mixed into ours.
        self._stderr = None if os.environ.get("MODELRUNNER_DEBUG") else tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "modelrunner_bench.worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._stderr, env=full_env, text=True, encoding="utf-8", bufsize=1,
        )

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return self._proc.pid

    def send(self, message: dict[str, Any]) -> None:
        """Write one request (without waiting for its reply)."""
        try:
            self._proc.stdin.write(json.dumps(message) + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerError(self._death()) from None

    def receive(self) -> dict[str, Any]:
        """Wait for the next reply.

        :raises WorkerError: the reply is an error, or the worker died (with its exit status and the
            last line it wrote to stderr).
        """
        line = self._proc.stdout.readline()
        if not line:
            raise WorkerError(self._death())
        reply = json.loads(line)
        if not reply.get("ok"):
            raise WorkerError(reply.get("error") or "the worker reported an error without a message")
        return reply

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        """:meth:`send` then :meth:`receive`."""
        self.send(message)
        return self.receive()

    def _death(self) -> str:
        try:
            code = self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            how = "stopped answering"
        elif code < 0:
            how = f"was killed by signal {signal.Signals(-code).name}"
        else:
            how = f"exited with status {code}"
        tail = ""
        if self._stderr is not None:
            self._stderr.seek(0)
            lines = [ln for ln in self._stderr.read().decode("utf-8", "replace").splitlines() if ln.strip()]
            tail = f": {lines[-1].strip()}" if lines else ""
        return f"the worker process {how}{tail}"

    def close(self) -> None:
        """Ask the worker to exit; kill it if it does not within 30 s. Idempotent."""
        if self._proc.poll() is None:
            try:
                self._proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self._proc.stdin.close()
            except OSError:
                pass
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for stream in (self._proc.stdout, self._stderr):
            if stream is not None:
                stream.close()


if __name__ == "__main__":
    sys.exit(main())
