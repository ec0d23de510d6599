"""The front of a data-parallel deployment spanning two machines: ``LLM(data_parallel_size=2,
data_parallel_size_local=1, ...)`` runs replica 0 here and waits for replica 1, which ``modelrunner
serve --headless`` runs on the other machine; rank 0's greedy tokens and each replica's share are saved.

Usage: ``python dp_front_workload.py CHECKPOINT ADDRESS RPC_PORT OUT.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel.workload import LLM_KW, MAX_TOKENS, PROMPTS  # noqa: E402

from modelrunner import LLM, SamplingParams  # noqa: E402


def main() -> None:
    checkpoint, address, port, out = sys.argv[1:]
    llm = LLM(checkpoint, data_parallel_size=2, data_parallel_size_local=1, data_parallel_address=address,
              data_parallel_rpc_port=int(port), **LLM_KW)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, n=2 if i == 3 else 1)
              for i, m in enumerate(MAX_TOKENS)]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    got = {"tokens": [[c.token_ids for c in o.outputs] for o in outputs],
           "errors": [o.error for o in outputs if o.error],
           "served": [r.served for r in llm.router.replicas],
           "hosts": [r.info["host"] for r in llm.router.replicas]}
    llm.shutdown()
    torch.save(got, out)


if __name__ == "__main__":
    main()
