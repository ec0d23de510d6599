"""Run in a fresh process by the cache tests: ``child_generate.py MODEL_DIR BACKEND CACHE_DIR``.

Generates the greedy completions of the shared prompts with the backend and prints one line,
``RESULT {"texts": [...], "compile": runner.stats()["compile"]}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from helpers import greedy_texts, make_llm  # noqa: E402


def main() -> None:
    model_dir, backend, cache_dir = sys.argv[1:4]
    llm = make_llm(Path(model_dir), backend, Path(cache_dir))
    texts = greedy_texts(llm)
    print("RESULT " + json.dumps({"texts": texts, "compile": llm.runner.stats().get("compile", {})}), flush=True)


if __name__ == "__main__":
    main()
