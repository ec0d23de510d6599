"""The docs' Python examples run: every ``python`` block of every page, a page's blocks in order in one
namespace, all pages in one interpreter (imports and the default model paid once).

What runs where (the convention on docs/recipes.md, "Code examples in the docs"): in a folder holding
``./my-llama``, a tiny random Llama (what the pages' ``./my-llama`` stands for); with blocks that call
``http://127.0.0.1:8000`` sent to ``modelrunner serve`` (the default model) that this test starts on a
free port. A block titled with a file name belongs to an example distribution that its own test
installs (the fp8 method: tests/quantization/test_fp8_docs_example.py); a ``<!-- not-run: reason -->``
comment leaves one block out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from docs_blocks import code_blocks

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MAX_NOT_RUN = 4
"""Most blocks the pages may leave out; each says why."""

pytestmark = pytest.mark.slow  # the pages use the real default model


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def _runnable(page: Path) -> list:
    return [b for b in code_blocks(page) if b.language == "python" and b.title is None and b.not_run is None]


PAGES = [page for page in _pages() if _runnable(page)]


def test_left_out_blocks_are_few_and_say_why():
    left_out = [b for page in _pages() for b in code_blocks(page) if b.not_run is not None]
    assert all(b.not_run for b in left_out)
    assert len(left_out) <= MAX_NOT_RUN, "\n".join(f"{b.where}: {b.not_run}" for b in left_out)


@pytest.fixture(scope="module")
def results(tmp_path_factory, smollm2_tokenizer, save_checkpoint):
    """Run every page's blocks in one interpreter, with a server starting alongside for the client
    examples; page → result."""
    from transformers import LlamaConfig

    from serve.conftest import ServerProcess

    work = tmp_path_factory.mktemp("docs-examples")
    tok = smollm2_tokenizer
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=512,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
                         architectures=["LlamaForCausalLM"])
    save_checkpoint(config, tok, work / "my-llama")
    pages = [{"page": str(page.relative_to(ROOT)),
              "blocks": [{"line": b.line, "code": b.code} for b in _runnable(page)]} for page in PAGES]
    (work / "pages.json").write_text(json.dumps(pages))
    server = ServerProcess([])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    runner = subprocess.Popen([sys.executable, str(ROOT / "tests" / "docs_blocks.py"), "pages.json", "results.json",
                               "server.txt"], cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        try:
            address = server.wait_ready().url
        except AssertionError as e:
            address = f"failed: {e}"
        (work / "server.txt").write_text(address)
        output, _ = runner.communicate(timeout=600)
    finally:
        runner.kill()
        server.stop()
    found = json.loads((work / "results.json").read_text()) if (work / "results.json").is_file() else {}
    return found, output


@pytest.mark.parametrize("page", [str(p.relative_to(ROOT)) for p in PAGES])
def test_the_page_examples_run(results, page):
    found, output = results
    assert page in found, f"the run stopped before {page}:\n{output[-4000:]}"
    assert found[page]["ok"], found[page]["error"]
