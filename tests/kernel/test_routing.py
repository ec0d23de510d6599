"""Hooks are routed by the name a plugin registered: only that plugin's hook runs, two plugins claiming
one name are a reported conflict resolved by an explicit choice, and a broken native adapter is loud.

Each case installs small plugin distributions on a subprocess's ``sys.path`` (real entry points).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from plugin_dists import make_distribution, run_cli

SHADOW = '''
"""Claims the Llama architecture too: a conflict with the llama adapter."""
from modelrunner import hookimpl

@hookimpl
def register(registry):
    registry.architectures("LlamaForCausalLM")

@hookimpl
def load(source):
    raise RuntimeError("the shadow adapter must not be asked to load")
'''

BYSTANDER = '''
"""Registers another architecture; its model hooks must never run for a model it did not load."""
from modelrunner import hookimpl

@hookimpl
def register(registry):
    registry.architectures("BystanderForCausalLM")

@hookimpl
def load(source):
    raise RuntimeError("bystander load called")

@hookimpl
def forward(loaded):
    raise RuntimeError("bystander forward called")

@hookimpl
def parallelize(loaded):
    raise RuntimeError("bystander parallelize called")

@hookimpl
def process_inputs(loaded):
    raise RuntimeError("bystander process_inputs called")

@hookimpl
def compile(name):
    raise RuntimeError("bystander compile called")

@hookimpl
def allocate(name):
    raise RuntimeError("bystander allocate called")
'''

WATCHER = '''
"""Wraps every model's forward (a tracer): wrappers of any plugin still run."""
import os
from modelrunner import hookimpl

@hookimpl(wrapper=True)
def forward(loaded, batch):
    with open(os.environ["WATCH_FILE"], "a") as f:
        f.write(f"{loaded.adapter} {batch.num_tokens}\\n")
    return (yield)
'''

BROKEN_NATIVE = '''
raise ImportError("needs the 'fastllama' package")
'''

GENERATE = """
import sys
from modelrunner import LLM, SamplingParams
llm = LLM(sys.argv[1], **dict(kv.split("=", 1) for kv in sys.argv[2:]))
out = llm.generate("hello world", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
print("ADAPTER", llm.runner.loaded.adapter, "TOKENS", len(out.outputs[0].token_ids))
"""


def _python(script: str, *args: str, pythonpath: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": f"{pythonpath}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=full_env,
                          timeout=300)


def test_only_the_owning_plugin_runs_and_wrappers_still_wrap(tmp_path, tiny_llama_dir):
    root = make_distribution(tmp_path / "site", "modelrunner-bystander", "bystander", "mr_bystander", BYSTANDER)
    make_distribution(root, "modelrunner-watcher", "watcher", "mr_watcher", WATCHER)
    watch = tmp_path / "forward.log"
    result = _python(GENERATE, str(tiny_llama_dir), pythonpath=root, env={"WATCH_FILE": str(watch)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ADAPTER llama TOKENS 3" in result.stdout
    calls = watch.read_text().split()
    assert calls[0] == "llama" and len(calls) >= 6  # the tracer saw every step (prefill + decodes)


def test_two_plugins_claiming_an_architecture_are_a_conflict_until_one_is_chosen(tmp_path, tiny_llama_dir):
    root = make_distribution(tmp_path / "site", "modelrunner-shadow", "shadow", "mr_shadow", SHADOW)
    listing = run_cli("plugins", pythonpath=root)
    assert "CONFLICT: architecture 'LlamaForCausalLM' is provided by llama, shadow; choose with adapter=" in listing.stdout
    check = run_cli("plugins", "--check", pythonpath=root)
    assert check.returncode == 1
    assert "check failed: architecture 'LlamaForCausalLM' is provided by several plugins: llama, shadow" in check.stderr
    refused = run_cli("generate", "--model", str(tiny_llama_dir), "--max-tokens", "2", "hi", pythonpath=root)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert ("architecture 'LlamaForCausalLM' is provided by several installed plugins ('llama', 'shadow'); "
            "choose one with adapter=<plugin>") in refused.stderr
    chosen = _python(GENERATE, str(tiny_llama_dir), "adapter=llama", pythonpath=root)
    assert chosen.returncode == 0, chosen.stderr[-3000:]
    assert "ADAPTER llama TOKENS 3" in chosen.stdout
    # Without the conflict, --check passes.
    assert run_cli("plugins", "--check").returncode == 0


def test_a_broken_native_adapter_is_named_when_the_generic_one_takes_over(tmp_path, tiny_llama_dir):
    root = make_distribution(tmp_path / "site", "modelrunner-fastllama", "fastllama", "mr_fastllama", BROKEN_NATIVE)
    result = _python(GENERATE, str(tiny_llama_dir), pythonpath=root, env={"MODELRUNNER_BLOCK_PLUGINS": "llama"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ADAPTER default-transformers TOKENS 3" in result.stdout
    assert ("no loaded plugin registers architecture 'LlamaForCausalLM', so the slow generic adapter "
            "'default-transformers' runs it; plugins that failed to load: fastllama: ImportError: needs the "
            "'fastllama' package") in result.stderr
    listed = {p["name"]: p for p in json.loads(run_cli("plugins", "--json", pythonpath=root).stdout)}
    assert listed["fastllama"]["error"] == "ImportError: needs the 'fastllama' package"
    assert run_cli("plugins", "--check", pythonpath=root).returncode == 1
