"""Two "machines" — two network namespaces joined by a veth pair, each with its own address — and
torchrun on each (``--nnodes=2``, c10d rendezvous on the first machine's address), as users run
modelrunner across machines: TP=2 and PP=2, each equal to one process's greedy tokens; and a
data-parallel deployment whose second replica runs on the other machine (``serve --headless``).

Creating namespaces needs root (CI runs as root); elsewhere these tests skip saying why. The flags are
the ones docs/guide/scaling.md shows.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from modelrunner import LLM

from .conftest import wait_for_no_children
from .workload import LLM_KW, run_workload

SCRIPT = Path(__file__).with_name("torchrun_workload.py")
DP_SCRIPT = Path(__file__).with_name("dp_front_workload.py")
RUN_TIMEOUT_S = 180
SUBNET = "10.231.{}.{}"
PORT = 29555


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _why_no_namespaces() -> str | None:
    if sys.platform != "linux":
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CI runs as root)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"mrprobe{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"`ip netns add` fails here: {getattr(e, 'stderr', '') or e}".strip()
    _ip("netns", "del", probe)
    return None


@pytest.fixture(scope="module")
def machines():
    """``[(namespace, address, interface), ...]`` for two namespaces on one veth link."""
    why = _why_no_namespaces()
    if why is not None:
        pytest.skip(why)
    tag = uuid.uuid4().hex[:6]
    net = int(tag[:2], 16) % 200 + 20
    made: list[str] = []
    out = []
    try:
        for i in (1, 2):
            name = f"mr{tag}{i}"
            _ip("netns", "add", name)
            made.append(name)
        _ip("link", "add", f"mrv{tag}1", "type", "veth", "peer", "name", f"mrv{tag}2")
        for i, name in enumerate(made, start=1):
            iface, address = f"mrv{tag}{i}", SUBNET.format(net, i)
            _ip("link", "set", iface, "netns", name)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", iface)
            _ip("-n", name, "link", "set", iface, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            out.append((name, address, iface))
        yield out
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_torchrun_on_two_machines_matches_one_process(machines, tiny_llama, tmp_path, tp, pp):
    expected = run_workload(LLM(str(tiny_llama), **LLM_KW))
    (_, first, _), _ = machines
    out = tmp_path / "got.pt"
    procs = []
    for i, (name, address, iface) in enumerate(machines):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "GLOO_SOCKET_IFNAME": iface}
        cmd = ["ip", "netns", "exec", name, sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
               "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint={first}:{PORT}",
               # The first machine hosts the rendezvous store (torchrun cannot tell its own address apart).
               # --local_addr: the address the other machine reaches this one at (the hostname is shared).
               f"--rdzv_id=mr{tp}{pp}", f"--rdzv_conf=is_host={int(i == 0)}", f"--local_addr={address}", str(SCRIPT), str(tiny_llama), str(tp), str(pp), str(out)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=RUN_TIMEOUT_S)[0])
    finally:
        for proc in procs:
            proc.kill()
    assert all(p.returncode == 0 for p in procs), "\n---\n".join(log[-4000:] for log in logs)
    got = torch.load(out)
    assert got["tokens"] == expected["tokens"]
    assert (got["logits"] - expected["logits"]).abs().max().item() <= 1e-4
    ranks = got["ranks"]
    assert [(r["tp_rank"], r["pp_rank"]) for r in ranks] == ([(0, 0), (1, 0)] if tp == 2 else [(0, 0), (0, 1)])
    assert wait_for_no_children() == []


def test_data_parallel_front_and_headless_machine_match_one_process(machines, tiny_llama, tmp_path):
    # The commands docs/guide/scaling.md shows: the front (here the offline API, as `serve` runs it) on
    # the first machine with one local replica, `modelrunner serve --headless` on the second.
    expected = run_workload(LLM(str(tiny_llama), **LLM_KW))["tokens"]
    (front_ns, first, _), (other_ns, _, _) = machines
    out = tmp_path / "dp.pt"
    # Replicas join from another machine: every machine needs the deployment's secret.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "MODELRUNNER_DP_SECRET": uuid.uuid4().hex}
    headless = subprocess.Popen(
        ["ip", "netns", "exec", other_ns, sys.executable, "-m", "modelrunner.cli", "serve", "--model",
         str(tiny_llama), *(f"--set={k}={v}" for k, v in LLM_KW.items()), "--headless", "--data-parallel-size", "2",
         "--data-parallel-size-local", "1", "--data-parallel-start-rank", "1", "--data-parallel-address", first,
         "--data-parallel-rpc-port", str(PORT + 1)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    front = subprocess.Popen(["ip", "netns", "exec", front_ns, sys.executable, str(DP_SCRIPT), str(tiny_llama), first,
                              str(PORT + 1), str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    logs = []
    try:
        for proc in (front, headless):
            logs.append(proc.communicate(timeout=RUN_TIMEOUT_S)[0])
    finally:
        for proc in (front, headless):
            proc.kill()
    assert front.returncode == 0 and headless.returncode == 0, "\n---\n".join(log[-4000:] for log in logs)
    got = torch.load(out)
    assert got["errors"] == [] and got["tokens"] == expected
    assert min(got["served"]) >= 1, got["served"]  # both machines' replicas answered
    assert wait_for_no_children() == []
