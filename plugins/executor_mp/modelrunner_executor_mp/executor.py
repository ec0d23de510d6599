"""The ``mp`` and ``torchrun`` executors: this process is rank 0 of a tensor × pipeline-parallel group.

:class:`MultiprocExecutor` (``mp``, the choice when ``tensor_parallel_size × pipeline_parallel_size``
is above 1) runs rank 0's shard (the first pipeline stage's tensor-parallel rank 0) with its own
runner, and each step broadcasts the batch (and pending KV block copies) to the other ranks and gets
the logits back from the last stage. The other ranks are worker processes it starts itself
(``python -m modelrunner_executor_mp.worker``: a fresh interpreter that never imports the user's
``__main__``, so ``python -c``, scripts without a ``__main__`` guard and interactive sessions all
work). :class:`TorchrunExecutor` (``torchrun``) drives the processes torchrun started instead: there
``LLM(...)`` on a rank other than 0 serves steps until rank 0 shuts down and then exits the process.

Failures: when any rank dies, raises or stops answering for ``MODELRUNNER_DIST_TIMEOUT`` seconds,
rank 0 raises :class:`~modelrunner.api.WorkerFailedError` naming the rank and the reason, then stops
the remaining workers. The executor is unusable afterwards; create a new one.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Protocol

import torch

from modelrunner.api import (Executor, ForwardBatch, ForwardOutput, LaunchInfo, LoadedModel, ModelRunner,
                             ModelRunnerError, Plugins, RunnerConfig, UniprocExecutor, WorkerFailedError,
                             collective_timeout)

from .group import DistributedContext, broadcast_object, destroy_distributed, free_port, init_distributed
from .processes import describe_exit, process_state, start_child
from .worker import (STEP, STOP, Worker, is_peer_failure, is_timeout, load_rank, rank_config, rank_device, read_failures,
                     run_step)

SETTLE_S = 5.0
"""After a collective fails, how long the driver waits for the failing rank's report or exit code."""
STOP_GRACE_S = 10.0
"""How long workers get to leave after a clean stop before they are killed."""
WATCH_INTERVAL_S = 0.5
"""How often rank 0 checks, between steps too, that the workers it started still run."""


def _join_torchrun(config: RunnerConfig, launch: LaunchInfo) -> TorchrunExecutor:
    device = rank_device(config, launch.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = init_distributed(launch, config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size,
                           device)
    if launch.rank == 0:
        return TorchrunExecutor(config, ctx, workers=None)
    Worker(ctx, config).run()
    destroy_distributed()
    try:
        ctx.store.set(f"closed/{launch.rank}", str(os.getpid()))  # rank 0 exits after this rank
    except Exception:  # noqa: BLE001 - rank 0 is gone already: nothing waits
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    # As a spawned worker does: skip interpreter teardown, which gloo's threads can abort ("terminate
    # called without an active exception") after a clean stop.
    os._exit(0)


class Workers(Protocol):
    """The ranks ``1 … world_size - 1`` an executor started: what rank 0 needs to watch, diagnose and
    stop them. :class:`WorkerProcesses` is ``mp``'s (local processes); an executor that
    starts its ranks elsewhere brings its own (:meth:`MultiprocExecutor.start_workers`)."""

    processes: dict[int, Any]
    """rank → a handle whose ``pid`` is the rank's process id (named in failure messages)."""

    def exited(self) -> dict[int, str]:
        """rank → how it ended (``exited with code 1``), for every rank that no longer runs."""

    def stopped(self) -> list[int]:
        """Ranks whose process is alive but stopped (``SIGSTOP``), where that can be told."""

    def raise_if_dead(self) -> None:
        """Raise :class:`WorkerFailedError` if a rank has ended already (called while they join)."""

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for every rank to end after a clean stop, then kill the rest."""

    def kill(self) -> None:
        """Kill every rank still running."""


class WorkerProcesses:
    """The worker processes rank 0 started, one per rank ``1 … world_size - 1``.

    Each is a fresh ``python -m modelrunner_executor_mp.worker`` in its own session (so stopping one stops what
    it started, and a Ctrl-C in the terminal reaches rank 0 only); each also kills itself when rank
    0 disappears.
    """

    def __init__(self, processes: dict[int, subprocess.Popen]) -> None:
        self.processes = processes
        """rank → the worker's process."""

    @classmethod
    def spawn(cls, config: RunnerConfig, master_addr: str, master_port: int) -> WorkerProcesses:
        """Start ranks ``1 … world_size - 1`` of ``config``'s group, meeting rank 0 at ``master_addr:master_port``."""
        world = config.parallel.world_size
        processes: dict[int, subprocess.Popen] = {}
        try:
            for rank in range(1, world):
                launch = LaunchInfo(rank=rank, world_size=world, local_rank=rank, master_addr=master_addr,
                                    master_port=master_port)
                processes[rank] = start_child("modelrunner_executor_mp.worker", (launch, config, os.getpid()))
        except BaseException:
            cls(processes).kill()
            raise
        return cls(processes)

    def exited(self) -> dict[int, str]:
        """rank → how it ended, for every worker that is no longer running."""
        return {rank: describe_exit(p.returncode) for rank, p in self.processes.items() if p.poll() is not None}

    def stopped(self) -> list[int]:
        """Ranks whose process is alive but stopped (e.g. by SIGSTOP)."""
        return [rank for rank, p in self.processes.items() if p.poll() is None and process_state(p.pid) in ("T", "t")]

    def raise_if_dead(self) -> None:
        """Raise :class:`WorkerFailedError` if a worker has already ended (used while waiting for it to join)."""
        for rank, how in self.exited().items():
            pid = self.processes[rank].pid
            raise WorkerFailedError(f"rank {rank} (pid {pid}) {how} while starting; its stderr above says why",
                                    rank, "starting")

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds in all for every worker to end, then kill the rest."""
        deadline = time.monotonic() + timeout
        for proc in self.processes.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """Kill every worker still running (with its process group) and reap it."""
        for proc in self.processes.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    proc.kill()
        for proc in self.processes.values():
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                pass


class WorkerWatcher:
    """Notices a started worker that ends while the group is open — also between steps, when no
    collective would — by polling the processes every :data:`WATCH_INTERVAL_S` from a daemon thread.

    :param workers: the processes to watch.
    :param tp_size: tensor-parallel size (to name a rank's place in the group).
    """

    def __init__(self, workers: Workers, tp_size: int, interval_s: float = WATCH_INTERVAL_S) -> None:
        self.failure: WorkerFailedError | None = None
        """The first worker seen ended, once one is."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(workers, tp_size, interval_s),
                                        name="modelrunner-worker-watcher", daemon=True)
        self._thread.start()

    def _watch(self, workers: Workers, tp_size: int, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            exited = workers.exited()
            if exited and not self._stop.is_set():
                rank, how = min(exited.items())
                pid = workers.processes[rank].pid
                self.failure = WorkerFailedError(
                    f"rank {rank} (tensor-parallel rank {rank % tp_size}, pipeline stage {rank // tp_size}, "
                    f"pid {pid}) {how}", rank, "serving")
                return

    def stop(self) -> None:
        """Stop watching (before the workers are told to leave, so their exit is not a failure)."""
        self._stop.set()


class _Group:
    """What closing the group needs, kept apart from the executor so a finalizer can close it."""

    def __init__(self, ctx: DistributedContext, workers: Workers | None) -> None:
        self.ctx = ctx
        """Rank 0's membership of the group."""
        self.workers = workers
        """The started workers (None under torchrun)."""
        self.watcher = WorkerWatcher(workers, ctx.parallel.tp_size) if workers is not None else None
        """Watches the started workers while the group is open."""
        self.broken = False
        """A rank failed: the others cannot be told to stop, only killed."""
        self.closed = False
        """:meth:`close` ran."""
        self.ranks: list[dict[str, Any]] = []
        """What every rank reported once loaded (for the pids of the ranks to wait for at close)."""

    def close(self) -> None:
        """Tell the other ranks to stop (or kill the started ones when broken), then leave the group."""
        if self.closed:
            return
        self.closed = True
        if self.watcher is not None:
            self.watcher.stop()
            self.broken = self.broken or self.watcher.failure is not None
        if not self.broken:
            try:
                broadcast_object((STOP,), self.ctx.control_group)
            except Exception:  # noqa: BLE001 - a peer is gone; kill below
                self.broken = True
        if self.workers is not None:
            self.workers.join(0.0 if self.broken else STOP_GRACE_S)
        destroy_distributed()
        if self.workers is None and not self.broken:
            self._wait_for_torchrun_peers()

    def _wait_for_torchrun_peers(self) -> None:
        """Under torchrun, return once the other ranks have left the group and (those on this host)
        exited, for at most :data:`STOP_GRACE_S`: rank 0 is the user's process, and its interpreter
        teardown must not overlap the peers' closing their gloo connections to it (gloo's threads
        reporting the closed sockets then abort it: "terminate called without an active exception")."""
        deadline = time.monotonic() + STOP_GRACE_S
        keys = [f"closed/{r}" for r in range(1, self.ctx.world_size)]
        try:
            self.ctx.store.wait(keys, timedelta(seconds=STOP_GRACE_S))
            pids = [int(self.ctx.store.get(k)) for k in keys]
        except Exception:  # noqa: BLE001 - a peer that never says so: stop waiting
            return
        host = socket.gethostname()
        local = [pid for pid, rank in zip(pids, self.ranks[1:], strict=False) if rank.get("host") == host]
        while local and time.monotonic() < deadline:
            local = [pid for pid in local if process_state(pid) not in (None, "Z", "X")]
            if local:
                time.sleep(0.01)


class MultiprocExecutor(Executor):
    """Rank 0 of a tensor × pipeline-parallel group: it has a runner for its own shard and drives the others.

    Built by :func:`modelrunner.api.create_executor`. Its ``execute_model`` broadcasts the batch and returns the last
    stage's logits; ``copy_blocks`` copies here at once and on the other ranks before the next step.

    :param config: the configuration (every rank gets the same).
    :param ctx: rank 0's membership of the process group.
    :param workers: the worker processes started here (None under torchrun).
    """

    name = "mp"
    parallel = True

    @classmethod
    def create(cls, config: RunnerConfig, plugins: Plugins | None = None) -> Executor:
        """Check the checkpoint and names (:meth:`check_runnable`), start ranks ``1 … world_size - 1``
        (:meth:`start_workers`), and become rank 0 of their group. With world size 1, a
        :class:`UniprocExecutor` (nothing to start)."""
        world = config.parallel.world_size
        if world == 1:
            return UniprocExecutor(config, plugins)
        # Resolve (and convert) the checkpoint and check the names before starting anything, so a bad
        # name costs no processes.
        cls.check_runnable(config, plugins)
        workers, master_addr, port = cls.start_workers(config)
        try:
            launch = LaunchInfo(rank=0, world_size=world, local_rank=0, master_addr=master_addr, master_port=port)
            ctx = init_distributed(launch, config.parallel.tensor_parallel_size,
                                   config.parallel.pipeline_parallel_size, rank_device(config, 0),
                                   while_waiting=workers.raise_if_dead)
        except BaseException:
            workers.kill()
            raise
        return cls(config, ctx, workers)

    @classmethod
    def check_runnable(cls, config: RunnerConfig, plugins: Plugins | None = None) -> None:
        """Resolve the checkpoint and check the configuration in this process, before any rank starts
        (:meth:`~modelrunner.api.ModelRunner.check_runnable`).

        :raises ModelRunnerError: (or ``ValueError``) what the first rank would fail on.
        """
        ModelRunner(config, plugins=plugins).check_runnable()

    @classmethod
    def start_workers(cls, config: RunnerConfig) -> tuple[Workers, str, int]:
        """Start ranks ``1 … world_size - 1``, each joining the group rank 0 hosts; the started ranks
        and the address and port rank 0 listens on. Here: worker processes on this machine
        (:class:`WorkerProcesses`); an executor plugin overrides this to start them elsewhere."""
        port = free_port()
        return WorkerProcesses.spawn(config, "127.0.0.1", port), "127.0.0.1", port

    def __init__(self, config: RunnerConfig, ctx: DistributedContext, workers: Workers | None) -> None:
        self.runner = ModelRunner(rank_config(config, ctx.device), parallel=ctx.parallel)
        self.ctx = ctx
        """This process's membership of the group (rank 0)."""
        self.workers = workers
        """The worker processes started here (None under torchrun)."""
        self.ranks: list[dict[str, Any]] = []
        """What every rank reported once loaded (pid, host, device, layers, KV blocks, plugins), by rank."""
        self.num_steps = 0
        """Steps run so far."""
        self._pending_copies: list[tuple[int, int]] = []
        self._failure: WorkerFailedError | None = None
        self._group = _Group(ctx, workers)
        self._finalizer = weakref.finalize(self, self._group.close)

    def load_model(self) -> LoadedModel:
        """Load every rank's shard (in step); the KV cache has the same number of blocks on every rank."""
        if self.runner.loaded is None:
            self.ranks = self._guarded("loading the model", load_rank, self.ctx, self.runner)
            self._group.ranks = self.ranks
        return self.runner.loaded

    def execute_model(self, batch: ForwardBatch) -> ForwardOutput:
        """Run one step on every rank; float32 logits ``[len(batch.logits_indices), vocab]`` on the CPU
        (``aux`` holds rank 0's extra outputs: with pipeline stages, the first stage's only).

        :raises WorkerFailedError: a rank died, raised or hung (now or in an earlier step).
        """
        self._require_loaded()
        copies, self._pending_copies = self._pending_copies, []
        out = self._guarded("running a step", self._step, batch, copies)
        self.num_steps += 1
        return out

    def forward(self, input_ids: torch.Tensor, return_router_logits: bool = False) -> torch.Tensor | dict[str, Any]:
        """As :meth:`ModelRunner.forward`; router logits only without pipeline stages (rank 0 holds
        the first stage's layers only).

        :raises ModelRunnerError: ``return_router_logits`` with ``pipeline_parallel_size`` > 1.
        """
        if return_router_logits and self.ctx.parallel.pp_size > 1:
            raise ModelRunnerError(
                f"return_router_logits needs pipeline_parallel_size=1 (got {self.ctx.parallel.pp_size}): each "
                "stage computes the router logits of its own layers only")
        return super().forward(input_ids, return_router_logits)

    def _step(self, batch: ForwardBatch, copies: list[tuple[int, int]]) -> ForwardOutput:
        broadcast_object((STEP, batch, copies), self.ctx.control_group, timeout_s=collective_timeout())
        return run_step(self.ctx, self.runner, batch, [])

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy KV blocks ``src → dst`` here now, and on the other ranks before the next step."""
        self._raise_if_unusable()
        self.runner.copy_blocks(copies)
        self._pending_copies += list(copies)

    def stats(self) -> dict[str, Any]:
        """Rank 0's runner statistics, plus ``parallel``: the sizes and every rank's report."""
        out = self.runner.stats()
        p = self.ctx.parallel
        out["parallel"] = {"tensor_parallel_size": p.tp_size, "pipeline_parallel_size": p.pp_size,
                           "ranks": self.ranks}
        return out

    def shutdown(self) -> None:
        """Stop the other ranks and leave the process group. Idempotent; also runs at exit."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        """True once shut down (or broken by a failure)."""
        return self._group.closed

    def check_health(self) -> None:
        """Raise if a rank has failed — in a step, or (seen by the watcher) while idle; in that case
        the group is shut down first. Call it from the thread that runs the steps.

        :raises WorkerFailedError: naming the rank and how it ended.
        """
        self._adopt_watched_failure()
        if self._failure is not None:
            self._raise_if_unusable()

    # -- failures --------------------------------------------------------------------------------

    def _adopt_watched_failure(self) -> None:
        watcher = self._group.watcher
        if self._failure is None and not self._group.closed and watcher is not None and watcher.failure is not None:
            self._failure = watcher.failure
            self.shutdown()

    def _raise_if_unusable(self) -> None:
        self._adopt_watched_failure()
        if self._failure is not None:
            f = self._failure
            raise WorkerFailedError(f"{f} (the parallel group is shut down; create a new LLM)", f.rank, f.phase)
        if self._group.closed:
            raise ModelRunnerError("this parallel executor was shut down; create a new one")

    def _guarded(self, phase: str, fn: Any, *args: Any) -> Any:
        self._raise_if_unusable()
        try:
            return fn(*args)
        except BaseException as exc:
            self._failure = self._diagnose(exc, phase)
            self._group.broken = True
            self.shutdown()
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt / SystemExit: the group is down, let it through
            raise self._failure from exc

    def _diagnose(self, exc: BaseException, phase: str) -> WorkerFailedError:
        """Which rank failed and why: a stopped (hung) worker; else rank 0 itself unless its error is a
        lost peer; then the rank that reported an error of its own, else the worker that exited (and
        how), else what is known."""
        stopped = self.workers.stopped() if self.workers is not None else []
        if stopped:
            rank = stopped[0]
            return WorkerFailedError(
                f"rank {self._where(rank)} stopped answering while {phase} (its process is stopped); the group "
                f"gave up after {collective_timeout():g} s (MODELRUNNER_DIST_TIMEOUT)", rank, phase)
        exited_now = self.workers.exited() if self.workers is not None else {}
        if not is_peer_failure(exc) and not exited_now:
            if is_timeout(exc):
                alive = sorted(self.workers.processes) if self.workers is not None else []
                who = f"rank(s) {', '.join(self._where(r) for r in alive)}" if alive else "a peer of rank 0"
                return WorkerFailedError(f"{who} did not answer within {collective_timeout():g} s "
                                         f"(MODELRUNNER_DIST_TIMEOUT) while {phase}: {exc}",
                                         alive[0] if alive else None, phase)
            return WorkerFailedError(f"rank 0 (the driver) raised while {phase}: {type(exc).__name__}: {exc}",
                                     0, phase)
        deadline = time.monotonic() + SETTLE_S
        first_exit = None
        while True:
            reports = {r: rep for r, rep in read_failures(self.ctx).items() if r != 0}
            exited = self.workers.exited() if self.workers is not None else {}
            if exited and first_exit is None:
                first_exit = time.monotonic()
            now = time.monotonic()
            # A rank that raised reports before it exits; give a report half a second to follow an exit.
            if any(not rep["peer"] for rep in reports.values()) or now > deadline or (
                    first_exit is not None and now - first_exit > 0.5):
                break
            time.sleep(0.05)
        for rank, rep in sorted(reports.items()):
            if not rep["peer"]:
                return WorkerFailedError(
                    f"rank {self._where(rank, rep['pid'])} raised while {rep['phase']}: {rep['error']}\n"
                    f"--- traceback of rank {rank} ---\n{rep['traceback']}", rank, phase)
        for rank, how in sorted(exited.items()):
            return WorkerFailedError(f"rank {self._where(rank)} {how} while {phase}", rank, phase)
        for rank, rep in sorted(reports.items()):
            return WorkerFailedError(f"rank {self._where(rank, rep['pid'])} lost a peer while {rep['phase']}: "
                                     f"{rep['error']}", rank, phase)
        return WorkerFailedError(
            f"a peer of rank 0 failed while {phase} and left no report ({type(exc).__name__}: {exc}); under "
            "torchrun, its log names the rank that exited", None, phase)

    def _where(self, rank: int, pid: int | None = None) -> str:
        tp = self.ctx.parallel.tp_size
        if pid is None and self.workers is not None and rank in self.workers.processes:
            pid = self.workers.processes[rank].pid
        where = f"{rank} (tensor-parallel rank {rank % tp}, pipeline stage {rank // tp}"
        return where + (f", pid {pid})" if pid is not None else ")")


class TorchrunExecutor(MultiprocExecutor):
    """Rank 0 of the processes ``torchrun`` started (one machine or several): as :class:`MultiprocExecutor`,
    but it starts nothing; on the other ranks :meth:`create` serves steps until rank 0 shuts down, then
    exits the process (vLLM's ``external_launcher``)."""

    name = "torchrun"
    launched_externally = True

    @classmethod
    def create(cls, config: RunnerConfig, plugins: Plugins | None = None) -> Executor:
        """Join torchrun's group (its environment says where).

        :raises ValueError: not started by torchrun, or it started a different number of processes.
        """
        launch = LaunchInfo.from_env()
        if launch is None:
            raise ValueError("distributed_executor_backend 'torchrun' (vLLM: 'external_launcher') needs the processes "
                             "torchrun starts (its WORLD_SIZE, RANK, MASTER_ADDR environment); run the script with "
                             "torchrun --nproc-per-node N, or leave distributed_executor_backend unset")
        return _join_torchrun(config, launch)

