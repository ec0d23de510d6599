"""What every rank of a parallel group runs: its part of a step, the loop of the ranks that wait for
steps, their failure reports, and the entry point of a worker process rank 0 started
(``python -m modelrunner_executor_mp.worker``, reading its launch information from stdin).

Every rank has a :class:`~modelrunner.api.ModelRunner` for its shard (rank 0's belongs to the
:class:`~modelrunner_executor_mp.executor.MultiprocExecutor`), and they all go through the same sequence
of collectives: join, wait for rank 0 to resolve the checkpoint, load (agreeing on the number of KV
blocks), report, then one :func:`run_step` per step rank 0 broadcasts.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from typing import Any

import attrs
import torch
import torch.distributed as dist

from modelrunner.api import (HIDDEN_STATES, STAGE_INPUTS, STAGE_OUTPUTS, ForwardBatch, ForwardOutput, LaunchInfo,
                             ModelRunner, ModelRunnerError, RunnerConfig, resolve_device, resolve_source)

from .group import (DistributedContext, broadcast_object, destroy_distributed, gather_objects, init_distributed,
                    recv_tensor_dict, send_tensor_dict)
from .processes import die_with_parent, read_orders

STEP = "step"
"""Message kind: ``(STEP, batch, block_copies)`` — run one step."""
STOP = "stop"
"""Message kind: ``(STOP,)`` — leave the loop; rank 0 is shutting down."""

PEER_FAILURE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                        "NCCL communicator was aborted", "ProcessGroup abort")
"""Substrings of the errors a collective raises when another rank, not this one, failed."""
TIMEOUT_MARKERS = ("Timed out", "timed out", "Timeout", "timeout")
"""Substrings of the errors a collective raises when a peer did not answer in time."""


def rank_device(config: RunnerConfig, local_rank: int) -> torch.device:
    """The device of the rank with ``local_rank``: GPU ``local_rank`` when the config runs on CUDA, else the CPU."""
    device = resolve_device(config.device)
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def rank_config(config: RunnerConfig, device: torch.device) -> RunnerConfig:
    """``config`` with the device of this rank."""
    return attrs.evolve(config, device=device.index) if device.type == "cuda" else config


# -- the sequence of collectives every rank goes through ----------------------------------------------


def load_rank(ctx: DistributedContext, runner: ModelRunner) -> list[dict[str, Any]] | None:
    """Load this rank's shard in step with the other ranks; every rank's :func:`rank_info` on rank 0.

    Rank 0 resolves the checkpoint first (a GGUF file is converted once, not by every rank at once).
    """
    cfg = runner.config.model
    if ctx.rank == 0:
        resolve_source(cfg.model, cfg.cache_dir, cfg.trust_remote_code)
    dist.barrier(group=ctx.control_group)
    runner.load_model()
    return gather_objects(rank_info(ctx, runner), ctx.stage_group)


def rank_info(ctx: DistributedContext, runner: ModelRunner) -> dict[str, Any]:
    """What a loaded rank reports to rank 0: where it runs, its shard, its plugins and KV cache."""
    p = ctx.parallel
    spec = runner.loaded.kv_cache_spec
    return {
        "rank": ctx.rank,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "device": str(runner.device),
        "tp_rank": p.tp_rank,
        "pp_rank": p.pp_rank,
        "num_layers": spec.num_layers if spec is not None else None,
        "num_blocks": runner.num_blocks,
        "kv_cache_bytes": runner.kv_cache_bytes,
        "plugins": sorted(name for name, info in runner.plugins.infos.items() if info.error is None),
    }


def run_step(ctx: DistributedContext, runner: ModelRunner, batch: ForwardBatch,
             block_copies: list[tuple[int, int]]) -> ForwardOutput | None:
    """This rank's part of one step; the step's output on rank 0, None on the others.

    Copies KV blocks, takes the previous stage's tensors (all stages but the first), runs this
    rank's layers, hands its outputs to the next stage (all but the last); the last stage's
    tensor-parallel rank 0 sends the logits to rank 0. Every message goes over groups bounded by
    ``MODELRUNNER_DIST_TIMEOUT``, so a hung peer fails the step instead of stalling it.
    """
    p = ctx.parallel
    runner.copy_blocks(block_copies)
    if not p.is_first_stage:
        inputs = recv_tensor_dict(ctx.prev_stage_rank, ctx.device, ctx.stage_group)
        batch = attrs.evolve(batch, extra={**batch.extra, STAGE_INPUTS: inputs})
    out: ForwardOutput | None = runner.execute_model(batch)
    if not p.is_last_stage:
        outputs = out.aux.get(STAGE_OUTPUTS)
        if outputs is None:
            raise ModelRunnerError(
                f"the {runner.loaded.adapter!r} adapter's forward hook returned no {STAGE_OUTPUTS!r} on pipeline "
                f"stage {p.pp_rank} of {p.pp_size}: it does not implement pipeline parallelism; "
                "use pipeline_parallel_size=1"
            )
        send_tensor_dict(outputs, ctx.next_stage_rank, ctx.stage_group)
        out = ForwardOutput(logits=torch.empty(0), aux={k: v for k, v in out.aux.items() if k != STAGE_OUTPUTS})
    if ctx.logits_rank == 0:
        return out if ctx.rank == 0 else None
    if ctx.rank == ctx.logits_rank:
        # Embedding requests' final hidden states come from the last stage too.
        hidden = {HIDDEN_STATES: out.aux[HIDDEN_STATES].float().cpu()} if HIDDEN_STATES in out.aux else {}
        send_tensor_dict({"logits": out.logits, **hidden}, 0, ctx.stage_group, group=ctx.stage_group)
    elif ctx.rank == 0:
        last = recv_tensor_dict(ctx.logits_rank, torch.device("cpu"), ctx.stage_group, group=ctx.stage_group)
        logits = last.pop("logits")
        return ForwardOutput(logits=logits, aux={**out.aux, **last})
    return None


class Worker:
    """A rank other than 0: loads its shard, then runs every step rank 0 broadcasts until told to stop.

    A failure is left in the rendezvous store (:func:`report_failure`) before it propagates, so
    rank 0 can say which rank failed and why.
    """

    def __init__(self, ctx: DistributedContext, config: RunnerConfig) -> None:
        self.ctx = ctx
        """This rank's process group membership."""
        self.runner = ModelRunner(rank_config(config, ctx.device), parallel=ctx.parallel)
        """The runner of this rank's shard (its plugins load from entry points in this process)."""
        self.phase = "loading the model"
        """What the rank is doing, for failure reports."""

    def run(self) -> None:
        """Load, serve steps, return when rank 0 stops the group."""
        try:
            load_rank(self.ctx, self.runner)
            while True:
                self.phase = "waiting for a step"
                message = broadcast_object(None, self.ctx.control_group, src=0)
                if message[0] == STOP:
                    return
                self.phase = "running a step"
                _, batch, copies = message
                run_step(self.ctx, self.runner, batch, copies)
        except BaseException as exc:
            report_failure(self.ctx, self.phase, exc)
            raise


# -- failure reports -----------------------------------------------------------------------------------


def is_peer_failure(exc: BaseException) -> bool:
    """True when ``exc`` is a collective failing because another rank went away (not this rank's fault)."""
    return isinstance(exc, dist.DistNetworkError) or any(m in str(exc) for m in PEER_FAILURE_MARKERS)


def is_timeout(exc: BaseException) -> bool:
    """True when ``exc`` is a collective giving up on a peer that did not answer in time."""
    return isinstance(exc, (TimeoutError, dist.DistStoreError)) or any(m in str(exc) for m in TIMEOUT_MARKERS)


def report_failure(ctx: DistributedContext, phase: str, exc: BaseException) -> None:
    """Leave this rank's failure in the rendezvous store for rank 0 (best effort: the store may be gone)."""
    record = {
        "rank": ctx.rank,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "phase": phase,
        "error": f"{type(exc).__name__}: {exc}",
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "peer": is_peer_failure(exc),
    }
    try:
        ctx.store.set(f"failure/{ctx.rank}", json.dumps(record))
    except Exception:  # noqa: BLE001 - rank 0 hosts the store and may be gone; the traceback still prints
        pass


def read_failures(ctx: DistributedContext) -> dict[int, dict[str, Any]]:
    """The failure reports other ranks left, by rank."""
    found = {}
    for rank in range(ctx.world_size):
        key = f"failure/{rank}"
        try:
            if ctx.store.check([key]):
                found[rank] = json.loads(ctx.store.get(key))
        except Exception:  # noqa: BLE001 - a store that cannot answer has nothing to tell
            break
    return found


# -- a spawned worker process --------------------------------------------------------------------------


def limit_threads(world_size: int) -> None:
    """Share the CPU cores among the ranks of this machine unless ``OMP_NUM_THREADS`` decides."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))


def serve_rank(launch: LaunchInfo, config: RunnerConfig) -> None:
    """Be rank ``launch.rank`` in this process: join the group rank 0 hosts at ``launch``'s address,
    load this rank's shard, run steps until rank 0 stops the group, then leave it.

    What a started rank runs, wherever it was started (a worker process, a Ray actor). A failure is
    reported to rank 0 (:func:`report_failure`) and raised; the group is then left as it is.
    """
    limit_threads(launch.world_size)
    device = rank_device(config, launch.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = init_distributed(launch, config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size,
                           device)
    Worker(ctx, config).run()
    destroy_distributed()


def worker_main(launch: LaunchInfo, config: RunnerConfig, parent_pid: int) -> None:
    """Run rank ``launch.rank`` in this process until rank 0 (``parent_pid``) stops the group.

    The process (started by rank 0 in a session of its own) kills itself when rank 0 disappears.
    """
    die_with_parent(parent_pid)
    try:
        serve_rank(launch, config)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        # Skip interpreter teardown: process-group threads of a broken group can abort it.
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown here too: gloo's threads can abort it ("terminate called without an
    # active exception") after a clean stop.
    os._exit(0)


def main() -> None:
    """``python -m modelrunner_executor_mp.worker``: read ``(launch, config, parent_pid)`` from stdin
    (:func:`read_orders`), then :func:`worker_main`."""
    launch, config, parent_pid = read_orders()
    worker_main(launch, config, parent_pid)


if __name__ == "__main__":
    main()
