"""Worker processes start as fresh interpreters (``python -m modelrunner_executor_mp.worker``), never re-importing
the user's ``__main__``: ``LLM(..., tensor_parallel_size=2)`` works from ``python -c``, from a script
without a ``__main__`` guard, and from an interactive session, and leaves no process behind."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CODE = """
from modelrunner import LLM, SamplingParams
llm = LLM({model!r}, tensor_parallel_size=2, dtype="float32", device="cpu", kv_cache_memory=2 << 20,
          max_model_len=64, block_size=4)
out = llm.generate([[5, 9, 2, 77], [3, 1, 4]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
print("TOKENS", [o.outputs[0].token_ids for o in out])
print("RANKS", [r["rank"] for r in llm.stats()["parallel"]["ranks"]])
"""


def _expected(tiny_llama) -> str:
    from modelrunner import LLM, SamplingParams

    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", kv_cache_memory=2 << 20, max_model_len=64, block_size=4)
    out = llm.generate([[5, 9, 2, 77], [3, 1, 4]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    return f"TOKENS {[o.outputs[0].token_ids for o in out]}"


@pytest.mark.parametrize("how", ["python -c", "script without a main guard", "interactive session"])
def test_tensor_parallel_llm_starts_from_anywhere(how, tiny_llama, tmp_path):
    code = CODE.format(model=str(tiny_llama))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if how == "python -c":
        command, stdin = [sys.executable, "-c", code], None
    elif how == "script without a main guard":
        script = tmp_path / "generate.py"
        script.write_text(code)
        command, stdin = [sys.executable, str(script)], None
    else:  # the REPL reads the statements from stdin, as a terminal user would type them
        command, stdin = [sys.executable, "-i", "-q"], code + "\nexit()\n"
    result = subprocess.run(command, input=stdin, capture_output=True, text=True, env=env, timeout=200,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _expected(tiny_llama) in result.stdout
    assert "RANKS [0, 1]" in result.stdout
