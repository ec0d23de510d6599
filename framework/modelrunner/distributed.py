"""What the model's own code knows of parallel ranks: the pipeline's stage hand-off keys, the layers
each stage runs, the collective timeout, and where torchrun placed this process.

Setting up the process groups and carrying steps between ranks is an executor's work: the
``modelrunner-executor-mp`` distribution (``mp`` and ``torchrun``) and the Ray executor built on it.
A single process needs none of it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs
import torch
import torch.distributed as dist

from . import wire

TIMEOUT_ENV = "MODELRUNNER_DIST_TIMEOUT"
"""Seconds a model collective may wait for its peers before failing (default :data:`DEFAULT_TIMEOUT_S`)."""
DEFAULT_TIMEOUT_S = 300.0
"""Collective timeout when ``$MODELRUNNER_DIST_TIMEOUT`` is unset. A peer that dies is noticed much
sooner on gloo (closed connection); this bounds a peer that hangs."""

STAGE_INPUTS = "stage_inputs"
"""``ForwardBatch.extra`` key holding, on every pipeline stage but the first, the tensors the
previous stage produced (the Llama adapter: ``{"hidden_states", "residual"}``)."""
STAGE_OUTPUTS = "stage_outputs"
"""``ForwardOutput.aux`` key under which a forward hook on a stage other than the last returns the
tensors for the next stage (its logits are then an empty ``[0, vocab]`` tensor)."""


@wire.register
@attrs.frozen
class LaunchInfo:
    """Where this process sits in the world and where the rendezvous store is."""

    rank: int
    """Global rank (``pp_rank * tp_size + tp_rank``)."""
    world_size: int
    """Number of processes."""
    local_rank: int
    """Rank on this machine (selects the GPU)."""
    master_addr: str
    """Host of the rendezvous store (rank 0's machine)."""
    master_port: int
    """Port of the rendezvous store."""
    agent_store: bool = False
    """torchrun's agent hosts the store, so no rank starts one (``TORCHELASTIC_USE_AGENT_STORE``)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LaunchInfo | None:
        """The values torchrun exports, or None when ``WORLD_SIZE`` is unset or 1.

        :raises ValueError: a variable is missing or not an integer (naming it).
        """
        env = os.environ if env is None else env
        if _env_int(env, "WORLD_SIZE", default=1) <= 1:
            return None
        return cls(
            rank=_env_int(env, "RANK"),
            world_size=_env_int(env, "WORLD_SIZE"),
            local_rank=_env_int(env, "LOCAL_RANK", default=_env_int(env, "RANK")),
            master_addr=env.get("MASTER_ADDR") or _missing("MASTER_ADDR"),
            master_port=_env_int(env, "MASTER_PORT"),
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        )


def _missing(name: str) -> Any:
    raise ValueError(f"environment variable {name} is not set; torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, "
                     "MASTER_ADDR and MASTER_PORT for every process it starts")


def _env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None or value == "":
        return _missing(name) if default is None else default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def collective_timeout() -> float:
    """Seconds from ``$MODELRUNNER_DIST_TIMEOUT``, else :data:`DEFAULT_TIMEOUT_S`."""
    raw = os.environ.get(TIMEOUT_ENV)
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}")
    return value


def stage_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The contiguous decoder layers ``[start, end)`` pipeline stage ``pp_rank`` runs.

    Layers are split as evenly as possible; the first ``num_layers % pp_size`` stages take one more
    (the last stage also runs the final norm and the LM head).

    :raises ValueError: more stages than layers, or a rank outside ``[0, pp_size)``.
    """
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank must be in [0, {pp_size}), got {pp_rank}")
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} layers; "
                         f"use at most {num_layers} stages")
    per_stage, extra = divmod(num_layers, pp_size)
    start = pp_rank * per_stage + min(pp_rank, extra)
    return start, start + per_stage + (1 if pp_rank < extra else 0)


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest ``value`` any rank of the world group holds (e.g. how many KV blocks all can fit)."""
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())
