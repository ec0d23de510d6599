"""The same ``LLM(...)`` code under ``torchrun --nproc_per_node=2``: rank 0 drives, rank 1 serves steps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modelrunner import LLM
from modelrunner_executor_mp import free_port

from .conftest import wait_for_no_children
from .workload import LLM_KW, run_workload

SCRIPT = Path(__file__).with_name("torchrun_workload.py")
RUN_TIMEOUT_S = 180


@pytest.mark.parametrize(("model", "tp", "pp"), [("tiny_llama", 2, 1), ("tiny_llama", 1, 2), ("tiny_mixtral", 1, 2)],
                         ids=["llama-tp2", "llama-pp2", "mixtral-pp2"])
def test_torchrun_two_processes_match_one_process(request, tmp_path, model, tp, pp):
    checkpoint = request.getfixturevalue(model)
    expected = run_workload(LLM(str(checkpoint), **LLM_KW))
    out = tmp_path / "got.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(SCRIPT), str(checkpoint), str(tp), str(pp), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    got = torch.load(out)
    diff = (got["logits"] - expected["logits"]).abs().max().item()
    print(f"torchrun {model} tp={tp} pp={pp}: max |logits - single process| = {diff:.2e}")
    assert diff <= 1e-4
    assert got["tokens"] == expected["tokens"]
    ranks = got["ranks"]
    assert [(r["tp_rank"], r["pp_rank"]) for r in ranks] == ([(0, 0), (1, 0)] if tp == 2 else [(0, 0), (0, 1)])
    assert ranks[0]["pid"] != ranks[1]["pid"]
    assert wait_for_no_children() == []
