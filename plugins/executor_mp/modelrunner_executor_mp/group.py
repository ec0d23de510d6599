"""Process groups for tensor × pipeline parallelism, and the collectives the ranks of a step use.

Ranks are laid out stage by stage: ``rank = pp_rank * tp_size + tp_rank``. Every process joins

- the world group (``nccl`` on GPU, ``gloo`` on CPU) for the model's own collectives: the
  all-reduces and gathers inside tensor-parallel layers, and hidden states sent between stages;
- its tensor-parallel and pipeline-parallel subgroups (in :class:`ParallelState`);
- a ``gloo`` *control* group over all ranks that carries the driver's step messages. Its timeout
  is long because ranks wait on it between requests; a dead peer still fails it at once (gloo sees
  the closed connection);
- a ``gloo`` *stage* group over all ranks for what moves inside a step on the CPU side (the shapes
  of the tensors passed between pipeline stages, the logits coming back to rank 0, load reports).

Every group but the control group times out after ``MODELRUNNER_DIST_TIMEOUT`` seconds, so a peer
that hangs inside a step (e.g. stopped by SIGSTOP) fails the step instead of stalling it.

The rendezvous is a ``TCPStore``: torchrun's (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``, its agent hosting the store), or one rank 0 hosts for workers it
spawned itself. Ranks also leave failure reports in that store (see :mod:`modelrunner_executor_mp.worker`).

The store is unauthenticated and lives as long as the model, so where rank 0 hosts it, it listens
only where the ranks can reach it: on loopback when ``master_addr`` is a loopback address (the
workers rank 0 spawns itself use ``127.0.0.1``; so does ``torchrun --standalone``), on every
interface otherwise. A run across machines needs the latter (the other machines connect to
``MASTER_ADDR``): keep such a cluster on a private network, as torchrun's own store requires.

What the ranks send each other outside the model's own tensors (step messages, load reports, the
shapes of stage tensors) travels as ``modelrunner.api.wire`` data: no rank unpickles what another sends.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import attrs
import torch
import torch.distributed as dist

from modelrunner.api import LaunchInfo, ParallelState, collective_timeout, wire

CONTROL_TIMEOUT = timedelta(days=30)
"""Timeout of the control group: ranks other than 0 may wait this long for the next step."""
STORE_PREFIX = "modelrunner/"
"""Prefix of the keys this package keeps in the rendezvous store (joins, failure reports)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (for a rendezvous on one machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def loopback_listener(host: str, port: int) -> socket.socket | None:
    """A socket listening on ``host:port`` for the store rank 0 hosts, when ``host`` is a loopback
    address (or a name resolving only to loopback); None otherwise (the store then listens on every
    interface, as a rendezvous across machines needs).

    ``TCPStore`` itself binds every interface; handed this socket (``master_listen_fd``) it accepts
    only connections from this machine.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return None
    if not infos or not all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos):
        return None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot host the rendezvous store on {host}:{port}: {e.strerror}") from None
    return sock


def global_rank(tp_rank: int, pp_rank: int, tp_size: int) -> int:
    """The world rank of tensor-parallel rank ``tp_rank`` on pipeline stage ``pp_rank``."""
    return pp_rank * tp_size + tp_rank


@attrs.define
class DistributedContext:
    """This process's membership of the parallel group, as :func:`init_distributed` set it up."""

    launch: LaunchInfo
    """Rank, world size and rendezvous address."""
    parallel: ParallelState
    """Tensor/pipeline ranks and subgroups, handed to the model runner."""
    backend: str
    """Backend of the world group: ``nccl`` or ``gloo``."""
    device: torch.device
    """The device this rank's model runs on."""
    control_group: Any
    """The gloo group over all ranks for step messages (no practical timeout: ranks wait on it)."""
    stage_group: Any
    """The gloo group over all ranks for messages inside a step (bounded by the collective timeout)."""
    store: Any
    """The rendezvous store under :data:`STORE_PREFIX` (failure reports)."""

    @property
    def rank(self) -> int:
        """Global rank."""
        return self.launch.rank

    @property
    def world_size(self) -> int:
        """Number of processes."""
        return self.launch.world_size

    @property
    def prev_stage_rank(self) -> int:
        """The rank of the previous stage with the same tensor-parallel rank (sends this rank its inputs)."""
        p = self.parallel
        return global_rank(p.tp_rank, p.pp_rank - 1, p.tp_size)

    @property
    def next_stage_rank(self) -> int:
        """The rank of the next stage with the same tensor-parallel rank (receives this rank's outputs)."""
        p = self.parallel
        return global_rank(p.tp_rank, p.pp_rank + 1, p.tp_size)

    @property
    def logits_rank(self) -> int:
        """The rank whose logits go back to rank 0: tensor-parallel rank 0 of the last stage."""
        p = self.parallel
        return global_rank(0, p.pp_size - 1, p.tp_size)


def init_distributed(
    launch: LaunchInfo,
    tp_size: int,
    pp_size: int,
    device: torch.device,
    timeout_s: float | None = None,
    while_waiting: Callable[[], None] | None = None,
) -> DistributedContext:
    """Join the process group and build the tensor- and pipeline-parallel subgroups.

    :param launch: this process's rank and the rendezvous address.
    :param device: where this rank's model runs; CUDA selects ``nccl``, anything else ``gloo``.
    :param timeout_s: timeout of model collectives (default :func:`collective_timeout`).
    :param while_waiting: called every 50 ms while waiting for the other ranks to join; rank 0
        passes a check that raises when a worker it spawned has died, so a failed start is reported
        at once instead of after the timeout.
    :raises ValueError: ``launch.world_size`` is not ``tp_size * pp_size``.
    """
    if launch.world_size != tp_size * pp_size:
        raise ValueError(
            f"{launch.world_size} processes were started, but tensor_parallel_size × pipeline_parallel_size = "
            f"{tp_size} × {pp_size} = {tp_size * pp_size}; start as many processes (torchrun --nproc_per_node "
            "× --nnodes) as the two sizes multiply to"
        )
    if dist.is_initialized():
        raise RuntimeError(
            f"torch.distributed is already initialised in this process (world size {dist.get_world_size()}); "
            "modelrunner sets up its own process group: create the LLM first, or destroy_process_group() before"
        )
    timeout = timedelta(seconds=timeout_s or collective_timeout())
    backend = "nccl" if device.type == "cuda" else "gloo"
    is_master = launch.rank == 0 and not launch.agent_store
    listener = loopback_listener(launch.master_addr, launch.master_port) if is_master else None
    store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, is_master=is_master,
                          timeout=timeout, wait_for_workers=False, multi_tenant=True,
                          master_listen_fd=listener.detach() if listener is not None else None)
    ours = dist.PrefixStore(STORE_PREFIX, store)
    ours.set(f"joined/{launch.rank}", str(os.getpid()))
    _wait_for_keys(ours, [f"joined/{r}" for r in range(launch.world_size)], timeout, while_waiting)
    dist.init_process_group(backend, store=dist.PrefixStore("pg/", store), rank=launch.rank,
                            world_size=launch.world_size, timeout=timeout)
    tp_group = pp_group = None
    tp_rank, pp_rank = launch.rank % tp_size, launch.rank // tp_size
    # Every rank must create every group, in the same order, even those it is not in.
    for stage in range(pp_size):
        ranks = [global_rank(t, stage, tp_size) for t in range(tp_size)]
        group = dist.new_group(ranks, timeout=timeout) if tp_size > 1 else None
        if stage == pp_rank:
            tp_group = group
    for t in range(tp_size):
        ranks = [global_rank(t, stage, tp_size) for stage in range(pp_size)]
        group = dist.new_group(ranks, timeout=timeout) if pp_size > 1 else None
        if t == tp_rank:
            pp_group = group
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    stages = dist.new_group(backend="gloo", timeout=timeout)
    parallel = ParallelState(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
                             tp_group=tp_group, pp_group=pp_group)
    return DistributedContext(launch, parallel, backend, device, control, stages, ours)


def _wait_for_keys(store: Any, keys: list[str], timeout: timedelta, while_waiting: Callable[[], None] | None) -> None:
    if while_waiting is None:
        store.wait(keys, timeout)
        return
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check(keys):
        while_waiting()
        if time.monotonic() > deadline:
            missing = [k for k in keys if not store.check([k])]
            raise TimeoutError(f"ranks did not join within {timeout.total_seconds():.0f} s: missing {missing}")
        time.sleep(0.05)


def destroy_distributed() -> None:
    """Leave the process group (every group of this process), if one is initialised."""
    if dist.is_initialized():
        dist.destroy_process_group()


# -- the collectives of a step -------------------------------------------------------------------


def _as_bytes_tensor(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(wire.encode(obj)), dtype=torch.uint8)


def broadcast_object(obj: Any, group: Any, src: int = 0, timeout_s: float | None = None) -> Any:
    """``obj`` from rank ``src`` on every rank of ``group`` (as :mod:`.wire` data; pass None on the others).

    :param timeout_s: how long this rank waits for the broadcast to complete (None: the group's
        timeout). Rank 0 bounds its step messages so a peer that stopped answering fails the step
        instead of blocking it (gloo's sender waits for every receiver).
    :raises TimeoutError: the broadcast did not complete within ``timeout_s``.
    """
    is_src = dist.get_rank() == src
    payload = _as_bytes_tensor(obj) if is_src else None
    size = torch.tensor([payload.numel() if is_src else 0], dtype=torch.int64)
    _wait(dist.broadcast(size, src=src, group=group, async_op=True), timeout_s, "the step message's size")
    if not is_src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    _wait(dist.broadcast(payload, src=src, group=group, async_op=True), timeout_s, "the step message")
    return obj if is_src else wire.decode(payload.numpy().tobytes())


def _wait(work: Any, timeout_s: float | None, what: str) -> None:
    if timeout_s is None:
        work.wait()
        return
    try:
        work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as e:
        if "timed out" not in str(e).lower():
            raise  # a peer that went away: the caller tells that apart
        raise TimeoutError(f"timed out after {timeout_s:g} s broadcasting {what} ({e})") from e


def gather_objects(obj: Any, group: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's ``obj`` (:mod:`.wire` data), in rank order, on rank ``dst`` (None elsewhere)."""
    payload = _as_bytes_tensor(obj)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64), group=group)
    longest = max(int(size.item()) for size in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:payload.numel()] = payload
    is_dst = dist.get_rank() == dst
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)] if is_dst else None
    dist.gather(padded, out, dst=dst, group=group)
    if not is_dst:
        return None
    return [wire.decode(t[:int(size.item())].numpy().tobytes()) for t, size in zip(out, sizes)]


def send_tensor_dict(tensors: Mapping[str, torch.Tensor], dst: int, meta_group: Any, group: Any = None) -> None:
    """Send named tensors to rank ``dst``: their shapes and dtypes over ``meta_group`` (gloo), the data
    over ``group`` (default: the world group, so on GPU the bytes move by NCCL)."""
    meta = _as_bytes_tensor([(name, tuple(t.shape), t.dtype) for name, t in tensors.items()])
    dist.send(torch.tensor([meta.numel()], dtype=torch.int64), dst=dst, group=meta_group)
    dist.send(meta, dst=dst, group=meta_group)
    for _, tensor in tensors.items():
        dist.send(tensor.contiguous(), dst=dst, group=group)


def recv_tensor_dict(src: int, device: torch.device, meta_group: Any, group: Any = None) -> dict[str, torch.Tensor]:
    """Receive what :func:`send_tensor_dict` on rank ``src`` sent, into new tensors on ``device``."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=src, group=meta_group)
    meta = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(meta, src=src, group=meta_group)
    out = {}
    for name, shape, dtype in wire.decode(meta.numpy().tobytes()):
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensor, src=src, group=group)
        out[name] = tensor
    return out
