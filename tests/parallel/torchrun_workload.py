"""Run under ``torchrun --nproc_per_node=2``: the workload on a parallel group; rank 0 saves what it got.

Usage: ``torchrun --nproc_per_node=2 torchrun_workload.py CHECKPOINT TP PP OUT.pt``. The same
``LLM(...)`` call as in a single process; on rank 1 it serves steps and exits when rank 0 is done.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel.workload import LLM_KW, run_workload  # noqa: E402

from modelrunner import LLM  # noqa: E402


def main() -> None:
    checkpoint, tp, pp, out = sys.argv[1:]
    llm = LLM(checkpoint, tensor_parallel_size=int(tp), pipeline_parallel_size=int(pp), **LLM_KW)
    got = run_workload(llm)  # only rank 0 gets here
    got["ranks"] = llm.runner.ranks
    llm.runner.shutdown()
    torch.save(got, out)


if __name__ == "__main__":
    main()
