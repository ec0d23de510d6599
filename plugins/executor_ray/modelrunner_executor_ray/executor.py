"""The ``ray`` executor: this process is rank 0 of the group, ranks ``1 … world_size - 1`` are Ray actors.

For people who already run Ray clusters (vLLM's ``distributed_executor_backend="ray"``). It joins
the cluster ``ray.init()`` finds — ``RAY_ADDRESS``, else a cluster started on this machine with
``ray start``, else a local one it starts and stops itself — places one actor per rank, and from
then on drives the group exactly as the ``mp`` executor (``modelrunner-executor-mp``) does (the same
collectives, the same failure reports): only where the ranks live differs.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import attrs

from modelrunner.api import LaunchInfo, Plugins, RunnerConfig, WorkerFailedError, collective_timeout
from modelrunner_executor_mp import MultiprocExecutor, free_port, process_state, rank_device, serve_rank

__all__ = ["RankActor", "RayExecutor", "RayWorkers"]


class RankActor:
    """One rank of the group, in a Ray worker process (made an actor class with ``ray.remote``)."""

    def where(self) -> dict[str, Any]:
        """Where this actor runs: its pid, its node's IP address, its host name."""
        import ray

        return {"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(), "host": socket.gethostname()}

    def serve(self, launch: LaunchInfo, config: RunnerConfig) -> None:
        """Be rank ``launch.rank`` until rank 0 stops the group (see :func:`modelrunner_executor_mp.serve_rank`)."""
        serve_rank(launch, config)


@attrs.define
class RayRank:
    """A started rank: its actor, where it runs, and the pending result of its ``serve`` call."""

    actor: Any
    """The actor's handle."""
    pid: int
    """The actor's process id."""
    node_ip: str
    """The IP address of the Ray node it runs on."""
    host: str
    """The host name of that node."""
    done: Any = None
    """The ``serve`` call's object ref: ready once the rank left the group, raised or died."""


class RayWorkers:
    """The ranks started as Ray actors (``modelrunner_executor_mp``'s ``Workers`` protocol, as
    ``WorkerProcesses`` is for local processes).

    :param ranks: rank → the started rank.
    :param owns_ray: this executor connected to Ray (``ray.init``), so it disconnects when done.
    """

    def __init__(self, ranks: dict[int, RayRank], owns_ray: bool) -> None:
        self.processes = ranks
        """rank → the started rank (its ``pid`` names it in failure messages)."""
        self.owns_ray = owns_ray
        """``ray.shutdown()`` once the ranks are stopped."""
        self._ended: dict[int, str] = {}
        self._killed = False

    @classmethod
    def start(cls, world_size: int, num_cpus: float) -> RayWorkers:
        """Connect to Ray (unless this process already is) and start ranks ``1 … world_size - 1``, each
        an actor asking for ``num_cpus`` CPUs; wait at most ``MODELRUNNER_DIST_TIMEOUT`` for Ray to
        place them.

        :raises WorkerFailedError: Ray placed not every actor in time (the cluster's free resources
            are in the message).
        """
        import ray

        owns_ray = not ray.is_initialized()
        if owns_ray:
            ray.init(include_dashboard=False, logging_level=logging.WARNING)
        actor_class = ray.remote(num_cpus=num_cpus)(RankActor)
        actors = {rank: actor_class.remote() for rank in range(1, world_size)}
        workers = cls({}, owns_ray)
        try:
            refs = {rank: actor.where.remote() for rank, actor in actors.items()}
            timeout = collective_timeout()
            ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
            if len(ready) < len(refs):
                missing = [rank for rank, ref in refs.items() if ref not in ready]
                raise WorkerFailedError(
                    f"Ray did not start rank(s) {missing} within {timeout:g} s (MODELRUNNER_DIST_TIMEOUT): each "
                    f"rank is an actor asking for {num_cpus:g} CPU; the cluster has "
                    f"{ray.available_resources().get('CPU', 0):g} CPU free of {ray.cluster_resources().get('CPU', 0):g}",
                    missing[0], "starting")
            for rank, ref in refs.items():
                info = ray.get(ref)
                workers.processes[rank] = RayRank(actors[rank], info["pid"], info["node_ip"], info["host"])
        except BaseException:
            for actor in actors.values():
                ray.kill(actor, no_restart=True)
            if owns_ray:
                ray.shutdown()
            raise
        return workers

    def master_address(self) -> str:
        """The address rank 0 hosts the group on: loopback when every rank runs on this machine, else
        this node's IP address as Ray knows it."""
        import ray

        here = ray.util.get_node_ip_address()
        if all(r.node_ip == here and r.host == socket.gethostname() for r in self.processes.values()):
            return "127.0.0.1"
        return here

    def serve(self, config: RunnerConfig, master_addr: str, master_port: int) -> None:
        """Have every actor join the group at ``master_addr:master_port`` and serve its rank."""
        world = len(self.processes) + 1
        for rank, r in self.processes.items():
            launch = LaunchInfo(rank=rank, world_size=world, local_rank=0, master_addr=master_addr,
                                master_port=master_port)
            r.done = r.actor.serve.remote(launch, config)

    # -- the Workers protocol ------------------------------------------------------------------------

    def exited(self) -> dict[int, str]:
        """rank → how it ended, for every rank whose ``serve`` call returned, raised, or whose actor died."""
        import ray

        pending = {r.done: rank for rank, r in self.processes.items() if r.done is not None and rank not in self._ended}
        if pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
            for ref in ready:
                self._ended[pending[ref]] = self._outcome(ref)
        return dict(self._ended)

    @staticmethod
    def _outcome(ref: Any) -> str:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        try:
            ray.get(ref, timeout=0)
        except RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            return f"raised {type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        except RayActorError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return f"died (its Ray actor ended: {first})"
        except Exception as e:  # noqa: BLE001 - any other way the call failed is an end too
            return f"ended: {type(e).__name__}: {e}"
        return "left the group"

    def stopped(self) -> list[int]:
        """Ranks on this machine whose actor process is alive but stopped (``SIGSTOP``)."""
        host, ended = socket.gethostname(), self.exited()
        return [rank for rank, r in self.processes.items()
                if r.host == host and r.pid and rank not in ended and process_state(r.pid) in ("T", "t")]

    def raise_if_dead(self) -> None:
        """Raise :class:`WorkerFailedError` if a rank has already ended (while the group forms)."""
        for rank, how in sorted(self.exited().items()):
            r = self.processes[rank]
            raise WorkerFailedError(f"rank {rank} (Ray actor, pid {r.pid} on {r.host}) {how} while starting",
                                    rank, "starting")

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for every rank's ``serve`` to return, then kill the actors."""
        import ray

        refs = [r.done for r in self.processes.values() if r.done is not None]
        if refs and timeout > 0:
            ray.wait(refs, num_returns=len(refs), timeout=timeout)
        self.kill()

    def kill(self) -> None:
        """Kill every actor, then disconnect from Ray if this executor connected. Idempotent."""
        if self._killed:
            return
        self._killed = True
        import ray

        if not ray.is_initialized():
            return
        for r in self.processes.values():
            try:
                ray.kill(r.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - an actor already gone
                pass
        if self.owns_ray:
            ray.shutdown()


class RayExecutor(MultiprocExecutor):
    """Rank 0 in this process, ranks ``1 … world_size - 1`` as Ray actors (one per rank, anywhere in
    the cluster): tensor- and pipeline-parallel steps as the ``mp`` executor runs them.

    With world size 1 there is nothing to place and it runs as ``uni``. CPU ranks only: a CUDA
    configuration is refused (rank 0 would share a GPU Ray hands an actor).
    """

    name = "ray"
    parallel = True
    num_cpus_per_rank: float = 1
    """CPUs each actor asks Ray for (Ray sets the actor's ``OMP_NUM_THREADS`` to it)."""

    @classmethod
    def create(cls, config: RunnerConfig, plugins: Plugins | None = None) -> Any:
        """Refuse a CUDA configuration, then build as ``mp`` does with the ranks placed by Ray.

        :raises ValueError: the configuration runs on CUDA.
        """
        device = rank_device(config, 0)
        if device.type != "cpu":
            raise ValueError(f"distributed_executor_backend 'ray' runs CPU ranks only (device {str(device)!r}); use "
                             "distributed_executor_backend='mp' for GPUs on one machine, or torchrun across machines")
        return super().create(config, plugins)

    @classmethod
    def start_workers(cls, config: RunnerConfig) -> tuple[RayWorkers, str, int]:
        """Place one actor per rank ``1 … world_size - 1`` and have them join rank 0 here."""
        workers = RayWorkers.start(config.parallel.world_size, cls.num_cpus_per_rank)
        try:
            master_addr = workers.master_address()
            port = free_port("127.0.0.1" if master_addr == "127.0.0.1" else "")
            workers.serve(config, master_addr, port)
        except BaseException:
            workers.kill()
            raise
        return workers, master_addr, port

    def stats(self) -> dict[str, Any]:
        """As ``mp``'s, plus ``parallel.ray``: each actor's node address."""
        out = super().stats()
        out["parallel"]["ray"] = {rank: {"node_ip": r.node_ip, "pid": r.pid}
                                  for rank, r in sorted(self.workers.processes.items())}
        return out
