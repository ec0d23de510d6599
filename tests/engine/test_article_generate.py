"""``ModelRunner.generate`` (the article's API) is a thin wrapper over the engine: the same tokens as
``LLM.generate``, through the engine that runs the runner (an LLM's, or one ``modelrunner.ModelRunner``
builds for itself), sharing its KV blocks with ``forward``. The kernel's runner and executors build no
engine: without one attached, ``engine()`` and ``generate`` say how to get one."""

from __future__ import annotations

import pytest
import torch

from modelrunner import LLM, LLMEngine, ModelRunner, ModelRunnerError, SamplingParams
from modelrunner.executor import UniprocExecutor
from modelrunner.runner import ModelRunner as KernelModelRunner

PROMPTS = [[5, 9, 2, 77, 31], [3, 1, 4]]
CONFIG = {"dtype": "float32", "max_model_len": 128, "kv_cache_memory": 1 << 22}


def test_a_bare_runner_generates_on_an_engine_of_its_own(tiny_llama_dir):
    runner = ModelRunner({"model": str(tiny_llama_dir), **CONFIG})
    assert isinstance(runner, KernelModelRunner)  # the kernel's runner, plus an engine built on first use
    runner.load_model()
    new = runner.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)
    engine = runner.engine()
    assert isinstance(engine, LLMEngine) and runner.engine() is engine  # made once, then reused
    want = LLM(model=str(tiny_llama_dir), **CONFIG).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        use_tqdm=False)
    assert [t.tolist() for t in new] == [o.outputs[0].token_ids for o in want]
    # forward's scratch sequences use the engine's allocator, not a second one over the same KV cache
    assert runner.scratch_allocator() is engine.allocator
    logits = runner.forward(PROMPTS[0])
    assert logits.shape[:2] == (1, len(PROMPTS[0]))
    assert engine.allocator.stats().used_blocks == 0
    # one prompt → one tensor; the engine's SamplingParams fields work (a penalty here)
    single = runner.generate(torch.tensor(PROMPTS[0]), max_new_tokens=4, repetition_penalty=1.3, ignore_eos=True)
    assert isinstance(single, torch.Tensor) and len(single) == 4


def test_an_llm_runner_generates_on_the_llm_engine(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), **CONFIG)
    assert llm.runner.engine() is llm.llm_engine
    steps = llm.llm_engine.num_steps
    new = llm.runner.generate(PROMPTS[1], max_new_tokens=3, ignore_eos=True)
    assert llm.llm_engine.num_steps > steps and len(new) == 3


def test_a_kernel_runner_or_executor_without_an_engine_says_how_to_get_one(tiny_llama_dir):
    runner = KernelModelRunner({"model": str(tiny_llama_dir), **CONFIG})
    runner.load_model()
    executor = UniprocExecutor(runner=runner)
    for target in (runner, executor):
        with pytest.raises(ModelRunnerError, match=r"no engine runs this .*modelrunner\.ModelRunner.*modelrunner\.LLM"):
            target.engine()
        with pytest.raises(ModelRunnerError, match="no engine runs this"):
            target.generate(PROMPTS[0], max_new_tokens=2)
        with pytest.raises(ValueError, match="temprature"):  # arguments are checked before the engine is asked for
            target.generate(PROMPTS[0], max_new_tokens=2, temprature=0.5)
    # forward needs no engine: its scratch blocks come from an allocator of the runner's own, freed after
    assert runner.forward(PROMPTS[0]).shape[:2] == (1, len(PROMPTS[0]))
    assert runner.scratch_allocator().stats().used_blocks == 0
    # an engine built on the executor attaches itself to it and to its runner: generate then runs on it
    engine = LLMEngine(executor)
    assert executor.engine() is engine and runner.engine() is engine
    assert runner.scratch_allocator() is engine.allocator and executor.scratch_allocator() is engine.allocator
    new = runner.generate(PROMPTS[0], max_new_tokens=3, ignore_eos=True)
    assert isinstance(new, torch.Tensor) and len(new) == 3


@pytest.mark.parametrize(("kwargs", "message"), [({"n": 2}, "n and max_tokens"), ({"max_tokens": 2}, "max_tokens"),
                                                 ({"temprature": 0.5}, "temprature")])
def test_refused_arguments_are_named(tiny_llama_dir, kwargs, message):
    runner = ModelRunner({"model": str(tiny_llama_dir), **CONFIG})
    runner.load_model()
    with pytest.raises(ValueError, match=message):
        runner.generate(PROMPTS[0], max_new_tokens=2, **kwargs)
