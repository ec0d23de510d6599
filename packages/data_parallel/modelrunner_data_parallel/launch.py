"""Starting replicas and waiting until each said ``ready``: on the front's machine, and on
``--headless`` machines that join it.

The front listens (:class:`~modelrunner.channel.ChannelListener`: peers prove they hold the
deployment's secret, then exchange :mod:`modelrunner.wire` data, never pickles) on
``data_parallel_address:data_parallel_rpc_port`` — 127.0.0.1 and a free port with a fresh random
secret when every replica runs here; :data:`~.protocol.SECRET_ENV` on every machine when some join
from elsewhere. Every replica, local or remote, connects to it, says which rank it is, loads its
model and says ``ready`` (or why it failed). Each replica is a fresh ``python -m
modelrunner_data_parallel.replica`` in its own session that dies with the process that started it.
"""

from __future__ import annotations

import logging
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Any

import attrs

from modelrunner import ModelRunnerError, RunnerConfig
from modelrunner.api import collective_timeout
# The kernel's authenticated channel (internal: modelrunner.channel).
from .channel import Channel, ChannelListener, wait
# How a child process ended, as the executor says it (internal: modelrunner.executor).
from modelrunner_executor_mp.processes import describe_exit, start_child  # a child with data orders on stdin

from .client import ReplicaClient
from .protocol import ReplicaOrders, deployment_secret

logger = logging.getLogger("modelrunner.data_parallel")


def replica_threads(config: RunnerConfig) -> int:
    """Threads per process when this machine's replicas and their ranks share its cores (as tensor-parallel
    ranks do)."""
    p = config.parallel
    local = p.data_parallel_size_local or p.data_parallel_size
    return max(1, (os.cpu_count() or 1) // (local * p.world_size))


def spawn_replica(config: RunnerConfig, rank: int, address: tuple[str, int], authkey: bytes) -> subprocess.Popen:
    """Start replica ``rank`` of ``config`` (a fresh interpreter in its own session) meeting the front at ``address``."""
    one = attrs.evolve(config, parallel=attrs.evolve(config.parallel, data_parallel_size=1,
                                                     data_parallel_size_local=None))
    orders = ReplicaOrders(config=one, rank=rank, address=address, authkey=authkey, parent_pid=os.getpid())
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(replica_threads(config)))
    return start_child("modelrunner_data_parallel.replica", orders, env)


def local_ranks(config: RunnerConfig) -> range:
    """The data-parallel ranks this machine runs."""
    p = config.parallel
    local = p.data_parallel_size_local or p.data_parallel_size
    return range(p.data_parallel_start_rank, p.data_parallel_start_rank + local)


def start_replicas(config: RunnerConfig) -> list[ReplicaClient]:
    """Listen, start this machine's replicas, and wait until every replica of the deployment, local or
    joining from elsewhere, is ready (those from elsewhere must connect within ``MODELRUNNER_DIST_TIMEOUT``
    seconds; then each is watched, as a local one is, until it says ready or fails).

    :raises ModelRunnerError: a replica failed to load, exited, or did not join in time (every replica
        started here is stopped then).
    """
    p = config.parallel
    size = p.data_parallel_size
    ranks = local_ranks(config)
    if ranks.stop > size:
        raise ValueError(f"data_parallel_size_local={len(ranks)} from data_parallel_start_rank="
                         f"{p.data_parallel_start_rank} exceeds data_parallel_size={size}")
    host = p.data_parallel_address or "127.0.0.1"
    authkey = deployment_secret(p.data_parallel_address, remote_replicas=len(ranks) < size)
    try:
        listener = ChannelListener((host, p.data_parallel_rpc_port), authkey)
    except OSError as e:
        raise ModelRunnerError(f"cannot listen for data-parallel replicas on {host}:{p.data_parallel_rpc_port}: "
                               f"{e.strerror or e} (data_parallel_address / data_parallel_rpc_port)") from None
    address = listener.address
    processes: dict[int, subprocess.Popen] = {}
    try:
        for rank in ranks:
            processes[rank] = spawn_replica(config, rank, address, authkey)
        return _gather(listener, size, processes)
    except BaseException:
        for proc in processes.values():
            proc.kill()
        raise
    finally:
        listener.close()


def _gather(listener: ChannelListener, size: int, processes: dict[int, subprocess.Popen]) -> list[ReplicaClient]:
    arrivals: queue.SimpleQueue = queue.SimpleQueue()
    listener.accept_in_background(arrivals.put)
    deadline = time.monotonic() + collective_timeout()
    pending: dict[Channel, int | None] = {}  # connection → its rank once it said hello
    ready: dict[int, tuple[Channel, dict[str, Any]]] = {}
    while len(ready) < size:
        while not arrivals.empty():
            pending[arrivals.get()] = None
        for conn in wait(list(pending), timeout=0.1) if pending else ():
            try:
                message = conn.recv()
                if not isinstance(message, (list, tuple)) or not message:
                    raise ValueError(f"a malformed message {message!r:.80}")
            except (EOFError, OSError, ValueError):
                rank = pending.pop(conn)
                conn.close()
                if rank is not None and rank not in processes:
                    raise ModelRunnerError(f"data-parallel replica {rank} (on another machine) closed its "
                                           "connection while loading; its log says why")
                continue  # a local one: its exit code is reported below
            rank = pending[conn]
            if message[0] == "hello":
                rank = message[1] if len(message) > 1 else None
                if not isinstance(rank, int) or not 0 <= rank < size or rank in ready or rank in pending.values():
                    conn.close()
                    pending.pop(conn)
                    logger.warning("refused a data-parallel replica claiming rank %r (data_parallel_size=%d)",
                                   rank, size)
                    continue
                pending[conn] = rank
            elif rank is None:
                conn.close()  # a peer must say which rank it is first
                pending.pop(conn)
            elif message[0] == "failed":
                raise ModelRunnerError(f"data-parallel replica {rank} failed to load the model: {message[1]}")
            elif message[0] == "ready":
                pending.pop(conn)
                ready[rank] = (conn, _ready_info(message))
                logger.info("data-parallel replica %d ready (pid %s on %s)", rank, message[1]["pid"],
                            message[1]["host"])
        if not pending:
            time.sleep(0.05)
        for rank, proc in processes.items():
            if rank not in ready and proc.poll() is not None:
                raise ModelRunnerError(f"data-parallel replica {rank} (pid {proc.pid}) {describe_exit(proc.returncode)}"
                                       " while starting; its stderr above says why")
        if time.monotonic() > deadline:  # local replicas are watched by their process, joined ones by their connection
            absent = sorted(set(range(size)) - set(ready) - set(pending.values()) - set(processes))
            if absent:
                raise ModelRunnerError(f"data-parallel replica(s) {absent} did not join within "
                                       f"{collective_timeout():g} s "
                                       "(MODELRUNNER_DIST_TIMEOUT); start them with serve --headless on their machines")
    return [ReplicaClient(rank, conn, info, processes.get(rank)) for rank, (conn, info) in sorted(ready.items())]


def _ready_info(message: Any) -> dict[str, Any]:
    """What a ``ready`` message told, its tokenizer rebuilt from its files.

    :raises ModelRunnerError: a malformed message.
    """
    from .protocol import tokenizer_from_files

    info = message[1] if len(message) > 1 else None
    needed = ("pid", "host", "tokenizer", "max_model_len", "root", "defaults", "image_token", "vocab_size",
              "max_num_seqs")
    if not isinstance(info, dict) or any(k not in info for k in needed):
        raise ModelRunnerError("a data-parallel replica said ready without describing its model")
    try:
        return {**info, "tokenizer": tokenizer_from_files(info["tokenizer"])}
    except ValueError as e:
        raise ModelRunnerError(str(e)) from None


def run_headless(config: RunnerConfig) -> int:
    """``serve --headless``: run this machine's replicas for a front elsewhere until they end; 0 when
    every one ended cleanly. SIGTERM/SIGINT stop them."""
    import signal

    p = config.parallel
    if p.data_parallel_address is None or not p.data_parallel_rpc_port:
        raise ValueError("--headless needs --data-parallel-address and --data-parallel-rpc-port: where the front "
                         "(the machine serving HTTP) listens for its replicas")
    address = (p.data_parallel_address, p.data_parallel_rpc_port)
    authkey = deployment_secret(p.data_parallel_address, remote_replicas=True)
    processes = {rank: spawn_replica(config, rank, address, authkey) for rank in local_ranks(config)}
    print(f"modelrunner: headless: data-parallel replica(s) {list(processes)} joining {address[0]}:{address[1]}",
          file=sys.stderr, flush=True)
    stop = threading.Event()

    def handle(signum: int, frame: Any) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handle)
    while not stop.is_set() and any(proc.poll() is None for proc in processes.values()):
        stop.wait(0.2)
    for proc in processes.values():
        if proc.poll() is None:
            proc.terminate()
    for proc in processes.values():
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return 0 if all(proc.returncode in (0, -signal.SIGTERM) for proc in processes.values()) else 1
