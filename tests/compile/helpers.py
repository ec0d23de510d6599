"""Helpers of the compile-backend tests (also imported by ``child_generate.py`` in a fresh process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

PROMPTS = ["The capital of France is", "Once upon a time, in a land far", "1, 2, 3, 4,"]
"""Three prompts of different lengths: a decode step of three rows is padded to a bucket of four."""
NEW_TOKENS = 20
"""Greedy tokens generated per prompt (the sequences cross a 16-token block boundary)."""
CHILD = Path(__file__).with_name("child_generate.py")


def compile_backends() -> list[str]:
    """Every installed compile backend but ``eager`` (the reference)."""
    from modelrunner.plugins import get_registry

    return [name for name in get_registry().names("compile_backends") if name != "eager"]


def make_llm(model_dir: Path, backend: str | None, cache_dir: Path | None = None,
             options: dict[str, Any] | None = None) -> Any:
    """An LLM on ``model_dir`` with ``backend`` (None: eager) and its ``compile_options``, prefix
    caching off so every step is recomputed."""
    from modelrunner import LLM

    config: dict[str, Any] = {"dtype": "float32", "enable_prefix_caching": False, "kv_cache_memory": 32 * 2**20}
    if backend is not None:
        config.update(compile=True, compile_backend=backend, compile_cache_dir=str(cache_dir),
                      compile_options=options or {})
    return LLM(model=str(model_dir), **config)


def greedy_texts(llm: Any) -> list[str]:
    """The greedy completions of :data:`PROMPTS`."""
    from modelrunner import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [out.outputs[0].text for out in llm.generate(PROMPTS, params, use_tqdm=False)]


def step_logits(runner: Any, prompts: list[list[int]], decode_tokens: list[list[int]]) -> list[torch.Tensor]:
    """Logits of one prefill step of all ``prompts`` then one decode step per row of ``decode_tokens``
    (the tokens each sequence is fed), through ``runner.execute_model``; the sequences are freed after."""
    alloc, block_size = runner.scratch_allocator(), runner.block_size
    seq_ids = list(range(900, 900 + len(prompts)))
    lengths = [len(p) for p in prompts]
    out = []
    try:
        for seq_id, prompt in zip(seq_ids, prompts):
            assert alloc.allocate(seq_id, prompt) == 0
        starts = [0] + list(torch.tensor(lengths).cumsum(0).tolist())
        out.append(runner.execute_model(_batch(
            alloc, block_size, seq_ids, [list(p) for p in prompts], [0] * len(prompts), starts)).logits)
        for tokens in decode_tokens:
            for seq_id, token in zip(seq_ids, tokens):
                assert alloc.append_slots(seq_id, [token]) == []
            out.append(runner.execute_model(_batch(
                alloc, block_size, seq_ids, [[t] for t in tokens], lengths, list(range(len(prompts) + 1)))).logits)
            lengths = [n + 1 for n in lengths]
    finally:
        for seq_id in seq_ids:
            alloc.free(seq_id)
    return out


def _batch(alloc: Any, block_size: int, seq_ids: list[int], new: list[list[int]], context: list[int],
           starts: list[int]) -> Any:
    from modelrunner import ForwardBatch

    ids, positions, slots, tables = [], [], [], []
    for seq_id, tokens, ctx in zip(seq_ids, new, context):
        ids += tokens
        positions += range(ctx, ctx + len(tokens))
        slots += alloc.slot_mapping(seq_id, ctx, ctx + len(tokens))
        tables.append(alloc.block_table(seq_id))
    width = max(len(t) for t in tables)
    seq_lens = [c + len(t) for c, t in zip(context, new)]
    return ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.tensor(positions), seq_ids=tuple(seq_ids),
        query_start_loc=torch.tensor(starts), seq_lens=torch.tensor(seq_lens), context_lens=torch.tensor(context),
        slot_mapping=torch.tensor(slots), block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        logits_indices=torch.tensor(starts[1:]) - 1, block_size=block_size,
        max_query_len=max(len(t) for t in new), max_seq_len=max(seq_lens),
    )


def run_child(model_dir: Path, backend: str, cache_dir: Path) -> tuple[dict[str, Any], str]:
    """Generate :data:`PROMPTS` in a fresh process; its texts and compile statistics, and its stderr."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(CHILD), str(model_dir), backend, str(cache_dir)],
                          capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):]), proc.stderr
