"""docs/recipes.md's "Add a sampling parameter", done as it says — a field on ``SamplingParams`` and
its processor in ``BUILTIN_PROCESSORS``, nothing else — on a copy of the kernel: the parameter then
reaches its processor from ``LLM.generate`` and from the HTTP server (whose request model and
validation follow from ``SamplingParams``), and a bad value is refused by the server naming it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from serve.conftest import TINY_ENV, ServerProcess, pythonpath_with

KERNEL = Path(__file__).resolve().parents[2] / "framework" / "modelrunner"
PROMPT = [5, 9, 2, 77, 31]
CONFIG = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory": 1 << 22}
"""The tiny model's config, offline and served."""

FIELD = '''
    banned_token: int | None = _FIELD(default=None, validator=_int_at_least(0, allow_none=True))
    """A token id never sampled (None: none)."""

'''
"""Step 1 of the recipe: the field, added to ``SamplingParams`` in ``modelrunner/sampling/params.py``."""
PROCESSOR = '''
class BannedTokenProcessor(BuiltinProcessor):
    """``banned_token``: that token's logit becomes -inf."""

    name, order = "banned_token", 45
    example_args = ({"banned_token": 3},)
    invalid_args = ({"banned_token": 10**9},)
    fields = ("banned_token",)

    def request_state(self, params: SamplingParams, args: dict[str, Any]) -> Any:
        if params.banned_token is None:
            return None
        _check_ids("banned_token", [params.banned_token], self.context.vocab_size)
        return params.banned_token

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
        for r, row in enumerate(rows):
            logits[r, row.state] = float("-inf")
        return logits


'''
"""Step 2: its processor, in ``modelrunner/sampling/builtin.py``."""

OFFLINE = '''
import json, sys
import modelrunner
from modelrunner import LLM, SamplingParams

assert modelrunner.__file__.startswith(sys.argv[2]), modelrunner.__file__  # the edited copy
llm = LLM(model=sys.argv[1], **json.loads(sys.argv[3]))
prompt = {"prompt_token_ids": json.loads(sys.argv[4])}
greedy = dict(max_tokens=4, temperature=0, ignore_eos=True)
plain = llm.generate(prompt, SamplingParams(**greedy), use_tqdm=False)[0].outputs[0].token_ids
banned = llm.generate(prompt, SamplingParams(**greedy, banned_token=plain[0]), use_tqdm=False)[0].outputs[0].token_ids
print(json.dumps({"plain": plain, "banned": banned}))
'''


def _insert(path: Path, before: str, text: str, replace: str | None = None) -> None:
    source = path.read_text()
    assert source.count(before) == 1, f"{path.name}: the recipe's anchor {before!r} moved"
    path.write_text(source.replace(before, text + (replace if replace is not None else before)))


@pytest.fixture(scope="module")
def kernel_copy(tmp_path_factory) -> Path:
    """The kernel with the new parameter, edited only where the recipe says."""
    root = tmp_path_factory.mktemp("kernel") / "framework"
    copy = shutil.copytree(KERNEL, root / "modelrunner", ignore=shutil.ignore_patterns("__pycache__"))
    _insert(copy / "sampling" / "params.py", "    def __attrs_post_init__(self) -> None:", FIELD.lstrip("\n"))
    _insert(copy / "sampling" / "builtin.py", "BUILTIN_PROCESSORS = (", PROCESSOR.lstrip("\n"),
            replace="BUILTIN_PROCESSORS = (BannedTokenProcessor, ")
    return root


def test_the_new_parameter_reaches_its_processor_offline_and_over_http(kernel_copy, tiny_llama_dir):
    env = {**TINY_ENV, "PYTHONPATH": pythonpath_with(kernel_copy)}
    options = [arg for key, value in CONFIG.items() for arg in ("--set", f"{key}={value}")]
    server = ServerProcess(["--model", str(tiny_llama_dir), *options], env=env)
    offline = subprocess.Popen([sys.executable, "-c", OFFLINE, str(tiny_llama_dir), str(kernel_copy),
                                json.dumps(CONFIG), json.dumps(PROMPT)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    with server.serving():
        # LLM.generate (run while the server started)
        stdout, stderr = offline.communicate(timeout=300)
        assert offline.returncode == 0, stderr[-3000:]
        out = json.loads(stdout.splitlines()[-1])
        assert out["plain"][0] not in out["banned"], out
        # the server: the same request field, its validation and its error naming it
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        plain = server.post("/v1/completions", json=body)
        assert plain.status_code == 200, plain.text
        assert plain.json()["choices"][0]["token_ids"] == out["plain"]
        banned = server.post("/v1/completions", json={**body, "banned_token": out["plain"][0]})
        assert banned.status_code == 200, banned.text
        assert banned.json()["choices"][0]["token_ids"] == out["banned"]
        refused = server.post("/v1/completions", json={**body, "banned_token": -1})
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["param"] == "banned_token", refused.text
        assert "banned_token must be an integer >= 0 or None" in error["message"]
        wrong_type = httpx.post(server.url + "/v1/completions", json={**body, "banned_token": "five"}, timeout=60)
        assert wrong_type.status_code == 400 and wrong_type.json()["error"]["param"] == "banned_token"
