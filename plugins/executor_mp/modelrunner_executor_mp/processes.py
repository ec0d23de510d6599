"""Child processes that get their orders as data: how rank 0 starts its workers (and
``modelrunner-data-parallel`` its replicas), how a child reads its orders and dies with its parent, and
how a child's end is described.

Orders travel on the child's stdin as ``modelrunner.api.wire`` data, never a pickle, so a child runs
nothing its parent did not name by module.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from modelrunner.api import wire


def start_child(module: str, orders: Any, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``python -m module`` in a session of its own and hand it ``orders`` on its stdin, as
    ``wire`` data (never a pickle), with this process's ``sys.path`` (:func:`read_orders` reads them)."""
    proc = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, start_new_session=True, env=env)
    assert proc.stdin is not None
    try:
        proc.stdin.write(wire.encode({"sys_path": list(sys.path), "orders": orders}))
        proc.stdin.close()
    except BaseException:
        proc.kill()
        raise
    return proc


def read_orders() -> Any:
    """In a process :func:`start_child` started: the orders from stdin, after putting the parent's
    ``sys.path`` entries in front of this one's (so the plugins it found are found here too)."""
    message = wire.decode(sys.stdin.buffer.read())
    for entry in reversed(message["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    return message["orders"]


def die_with_parent(parent_pid: int) -> None:
    """Kill this process group (this worker and anything it started) as soon as the parent is gone.

    On Linux the kernel also delivers SIGKILL when the parent dies (``PR_SET_PDEATHSIG``), which
    reaches even a stopped worker, whose own watcher thread cannot run.
    """
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        if os.getppid() != parent_pid:  # the parent died before the request took effect
            os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.2)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="modelrunner-parent-watch", daemon=True).start()


def describe_exit(exitcode: int | None) -> str:
    """``exited with code 1`` / ``was killed by signal SIGKILL`` for a process's exit code."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of a process (``R``, ``S``, ``T`` = stopped, ``Z``…), None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
