"""Executors are a registered kind: the kernel's ``uni`` and ``modelrunner-executor-mp``'s ``mp`` and
``torchrun`` are listed, ``distributed_executor_backend`` picks one by name (vLLM's values mapped), unknown
names and impossible combinations fail naming themselves, a group without the distribution names it,
and the ``uni`` executor passes its conformance suite."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from modelrunner.errors import UnknownNameError
from modelrunner.plugins import get_plugins
from plugin_dists import run_cli


def test_the_executors_are_listed_with_their_distributions():
    run = run_cli("plugins")
    assert run.returncode == 0, run.stderr
    assert "mp  (modelrunner-executor-mp 0.1.0)  hooks: register\n    executors: mp, torchrun\n" in run.stdout
    assert "default-executors  (modelrunner 0.1.0)  hooks: register\n    executors: uni\n" in run.stdout


def test_the_multiprocess_executors_are_their_distributions():
    infos = get_plugins().infos
    assert infos["mp"].distribution == "modelrunner-executor-mp"
    assert infos["mp"].provides == {"executors": ["mp", "torchrun"]}
    assert infos["default-executors"].provides == {"executors": ["uni"]}


WITHOUT_MP = r"""
import sys
from modelrunner import LLM
from modelrunner.errors import UnknownNameError

try:
    LLM(sys.argv[1], tensor_parallel_size=2)
except UnknownNameError as e:
    print(e)
"""


def test_a_group_without_the_mp_distribution_says_what_to_install(tiny_llama_dir):
    env = {**os.environ, "MODELRUNNER_BLOCK_PLUGINS": "mp"}
    run = subprocess.run([sys.executable, "-c", WITHOUT_MP, str(tiny_llama_dir)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert ("unknown executor 'mp'; installed: ray, uni ('mp' comes with the modelrunner-executor-mp distribution: "
            "pip install modelrunner-executor-mp)") in run.stdout


def test_names_select_and_bad_ones_are_refused(tiny_llama_dir):
    from modelrunner import LLM
    from modelrunner.executor import UniprocExecutor, executor_name
    from modelrunner.config import RunnerConfig
    from modelrunner_executor_mp import TorchrunExecutor

    assert get_plugins().executor_class("torchrun") is TorchrunExecutor
    config = RunnerConfig.from_dict({"model": "m", "distributed_executor_backend": "external_launcher"})
    assert executor_name(config) == "torchrun"  # vLLM's name for it
    assert executor_name(RunnerConfig.from_dict({"model": "m"})) == "uni"
    assert executor_name(RunnerConfig.from_dict({"model": "m", "tensor_parallel_size": 2})) == "mp"
    with pytest.raises(UnknownNameError, match=r"unknown executor 'dask'; installed: mp, ray, torchrun, uni"):
        LLM(str(tiny_llama_dir), distributed_executor_backend="dask")
    with pytest.raises(ValueError, match=r"'uni' runs one process; .* = 2 needs one that runs several"):
        LLM(str(tiny_llama_dir), distributed_executor_backend="uni", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"'torchrun' \(vLLM: 'external_launcher'\) needs the processes torchrun"):
        LLM(str(tiny_llama_dir), distributed_executor_backend="external_launcher", tensor_parallel_size=2)
    llm = LLM(str(tiny_llama_dir), distributed_executor_backend="uni", compile=False, kv_cache_memory=4 << 20)
    assert type(llm.runner) is UniprocExecutor


def test_the_uni_executor_passes_its_suite():
    from modelrunner_kit.conformance import suite

    results = {r.check: r.status for r in suite("executors", "uni").run()}
    assert results == {"runs-like-one-process": "passed", "refuses-what-it-cannot-run": "passed"}
