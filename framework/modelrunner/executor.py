"""Tensor × pipeline parallelism behind the ModelRunner API, so :class:`LLMEngine` drives it unchanged.

:func:`create_executor` returns a plain :class:`~modelrunner.runner.ModelRunner` when
``tensor_parallel_size × pipeline_parallel_size`` is 1. Otherwise this process becomes rank 0 of the
group, the *driver*: it runs model code like every other rank (its tensor-parallel shard of the
first pipeline stage) and also owns the engine, the scheduler and the one KV block allocator whose
block tables every stage follows. Each step it broadcasts the batch (and pending KV block copies)
to the other ranks, runs its own part, and gets the logits back from the last stage.

The other ranks are either worker processes the driver spawns (``torch.multiprocessing``, spawn)
or, under ``torchrun``, the other processes torchrun started: there ``LLM(...)`` on a rank other
than 0 serves steps until rank 0 shuts down and then exits the process.

Failures: when any rank dies or raises, the driver raises :class:`WorkerFailedError` naming the
rank and the reason (a killed worker is seen within seconds: gloo notices the closed connection),
then stops the remaining workers. The executor is unusable afterwards; create a new one.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import weakref
from typing import Any

import torch
import torch.multiprocessing as mp

from .config import RunnerConfig
from .distributed import (
    DistributedContext,
    LaunchInfo,
    broadcast_object,
    destroy_distributed,
    free_port,
    init_distributed,
)
from .errors import FatalError, ModelRunnerError
from .forward_batch import ForwardBatch
from .runner import ModelRunner
from .source import resolve_source
from .worker import STEP, STOP, Worker, is_peer_failure, load_rank, rank_config, rank_device, read_failures, \
    run_step, worker_main

SETTLE_S = 5.0
"""After a collective fails, how long the driver waits for the failing rank's report or exit code."""
STOP_GRACE_S = 10.0
"""How long workers get to leave after a clean stop before they are killed."""


class WorkerFailedError(FatalError):
    """A rank of the parallel group died or raised; the group has been shut down.

    :param rank: the rank at fault (None when it cannot be told, e.g. a torchrun peer that vanished).
    :param phase: what the group was doing (``"loading the model"``, ``"running a step"``).
    """

    def __init__(self, message: str, rank: int | None = None, phase: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        """The rank at fault, when known."""
        self.phase = phase
        """What the group was doing."""


def create_executor(config: RunnerConfig | dict[str, Any]) -> ModelRunner:
    """The runner for ``config``, not yet loaded (call ``load_model()``).

    World size 1: a :class:`ModelRunner`. Otherwise a :class:`ParallelExecutor` that is rank 0 of
    the group: of the processes torchrun started when its environment says so (``WORLD_SIZE`` > 1),
    else of worker processes spawned here. Under torchrun, on ranks other than 0 this call loads
    that rank's shard, serves steps until rank 0 shuts down, and then exits the process.

    :raises ValueError: torchrun started a different number of processes than the sizes multiply to.
    """
    config = RunnerConfig.from_dict(config) if isinstance(config, dict) else config
    world = config.parallel.world_size
    if world == 1:
        return ModelRunner(config)
    launch = LaunchInfo.from_env()
    if launch is not None:
        return _join_torchrun(config, launch)
    # Resolve (and convert) the checkpoint before starting anything, so a bad name costs no processes.
    resolve_source(config.model.model, config.model.cache_dir, config.model.trust_remote_code)
    port = free_port()
    workers = WorkerProcesses.spawn(config, "127.0.0.1", port)
    try:
        launch = LaunchInfo(rank=0, world_size=world, local_rank=0, master_addr="127.0.0.1", master_port=port)
        ctx = init_distributed(launch, config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size,
                               rank_device(config, 0), while_waiting=workers.raise_if_dead)
    except BaseException:
        workers.kill()
        raise
    return ParallelExecutor(config, ctx, workers)


def _join_torchrun(config: RunnerConfig, launch: LaunchInfo) -> ModelRunner:
    device = rank_device(config, launch.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = init_distributed(launch, config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size,
                           device)
    if launch.rank == 0:
        return ParallelExecutor(config, ctx, workers=None)
    Worker(ctx, config).run()
    destroy_distributed()
    sys.exit(0)


def describe_exit(exitcode: int | None) -> str:
    """``exited with code 1`` / ``killed by signal SIGKILL`` for a process's exit code."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class WorkerProcesses:
    """The worker processes the driver spawned, one per rank ``1 … world_size - 1``.

    Each leads its own process group (see :func:`~modelrunner.worker.worker_main`), so stopping
    one also stops whatever it started; each also kills itself when the driver disappears.
    """

    def __init__(self, processes: dict[int, Any]) -> None:
        self.processes = processes
        """rank → ``multiprocessing.Process``."""

    @classmethod
    def spawn(cls, config: RunnerConfig, master_addr: str, master_port: int) -> WorkerProcesses:
        """Start ranks ``1 … world_size - 1`` of ``config``'s group, meeting rank 0 at ``master_addr:master_port``."""
        ctx = mp.get_context("spawn")
        world = config.parallel.world_size
        processes = {}
        for rank in range(1, world):
            launch = LaunchInfo(rank=rank, world_size=world, local_rank=rank, master_addr=master_addr,
                                master_port=master_port)
            # daemon: if the driver's interpreter exits without closing us, multiprocessing terminates us.
            proc = ctx.Process(target=worker_main, args=(launch, config, os.getpid()),
                               name=f"modelrunner-rank{rank}", daemon=True)
            proc.start()
            processes[rank] = proc
        return cls(processes)

    def exited(self) -> dict[int, str]:
        """rank → how it ended, for every worker that is no longer running."""
        return {rank: describe_exit(p.exitcode) for rank, p in self.processes.items() if not p.is_alive()}

    def raise_if_dead(self) -> None:
        """Raise :class:`WorkerFailedError` if a worker has already ended (used while waiting for it to join)."""
        for rank, how in self.exited().items():
            pid = self.processes[rank].pid
            raise WorkerFailedError(
                f"rank {rank} (pid {pid}) {how} while starting; its stderr above says why (workers are spawned: a "
                "script must create the LLM under `if __name__ == \"__main__\":`)", rank, "starting")

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds in all for every worker to end, then kill the rest."""
        deadline = time.monotonic() + timeout
        for proc in self.processes.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kill every worker still running (with its process group) and reap it."""
        for proc in self.processes.values():
            if proc.is_alive():
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):  # it has not made its own group yet
                    proc.kill()
        for proc in self.processes.values():
            proc.join(5.0)


class _Group:
    """What closing the group needs, kept apart from the executor so a finalizer can close it."""

    def __init__(self, ctx: DistributedContext, workers: WorkerProcesses | None) -> None:
        self.ctx = ctx
        """Rank 0's membership of the group."""
        self.workers = workers
        """The spawned workers (None under torchrun)."""
        self.broken = False
        """A rank failed: the others cannot be told to stop, only killed."""
        self.closed = False
        """:meth:`close` ran."""

    def close(self) -> None:
        """Tell the other ranks to stop (or kill the spawned ones when broken), then leave the group."""
        if self.closed:
            return
        self.closed = True
        if not self.broken:
            try:
                broadcast_object((STOP,), self.ctx.control_group)
            except Exception:  # noqa: BLE001 - a peer is gone; kill below
                self.broken = True
        if self.workers is not None:
            self.workers.join(0.0 if self.broken else STOP_GRACE_S)
        destroy_distributed()


class ParallelExecutor(ModelRunner):
    """Rank 0 of a tensor × pipeline-parallel group: a :class:`ModelRunner` whose steps run on every rank.

    Built by :func:`create_executor`. Its allocator decides the block tables of every stage; its
    ``execute_model`` broadcasts the batch and returns the last stage's logits; ``copy_blocks``
    copies here at once and on the other ranks before the next step. ``forward``, ``generate``
    and ``stats`` work as on a :class:`ModelRunner` (``last_aux`` is rank 0's: with several
    pipeline stages, only the first stage's router logits).
    """

    def __init__(self, config: RunnerConfig, ctx: DistributedContext, workers: WorkerProcesses | None) -> None:
        super().__init__(rank_config(config, ctx.device), parallel=ctx.parallel)
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

    # -- the ModelRunner API ---------------------------------------------------------------------

    def load_model(self) -> Any:
        """Load every rank's shard (in step); the KV cache has the same number of blocks on every rank."""
        if self.loaded is None:
            self.ranks = self._guarded("loading the model", load_rank, self.ctx, self)
        return self.loaded

    def execute_model(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one step on every rank; float32 logits ``[len(batch.logits_indices), vocab]`` on the CPU.

        :raises WorkerFailedError: a rank died or raised (now or in an earlier step).
        """
        self._require_loaded()
        copies, self._pending_copies = self._pending_copies, []
        logits = self._guarded("running a step", self._step, batch, copies)
        self.num_steps += 1
        return logits

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

    def _step(self, batch: ForwardBatch, copies: list[tuple[int, int]]) -> torch.Tensor:
        broadcast_object((STEP, batch, copies), self.ctx.control_group)
        return run_step(self.ctx, self, batch, [])

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy KV blocks ``src → dst`` here now, and on the other ranks before the next step."""
        self._raise_if_unusable()
        ModelRunner.copy_blocks(self, copies)
        self._pending_copies += list(copies)

    def stats(self) -> dict[str, Any]:
        """:meth:`ModelRunner.stats` of rank 0, plus ``parallel``: the sizes and every rank's report."""
        out = super().stats()
        p = self.parallel
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

    # -- failures --------------------------------------------------------------------------------

    def _raise_if_unusable(self) -> None:
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
        """Which rank failed and why: rank 0 itself unless its error is a lost peer; then the rank that
        reported an error of its own, else the worker that exited (and how), else what is known."""
        if not is_peer_failure(exc):
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
        tp = self.parallel.tp_size
        if pid is None and self.workers is not None and rank in self.workers.processes:
            pid = self.workers.processes[rank].pid
        where = f"{rank} (tensor-parallel rank {rank % tp}, pipeline stage {rank // tp}"
        return where + (f", pid {pid})" if pid is not None else ")")
