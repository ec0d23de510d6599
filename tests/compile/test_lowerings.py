"""Compiled graphs run the kernel's custom ops as native code: no per-layer call back into Python."""

from __future__ import annotations

import pytest
from torch.profiler import ProfilerActivity, profile

from .helpers import PROMPTS, compile_backends, step_logits

pytest.importorskip("modelrunner_compile_inductor")

PYTHON_OPS = ("modelrunner::store_kv", "modelrunner::onednn_linear")


def _events(llm, tokenizer) -> set[str]:
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    # Once unprofiled: a step that compiles (e.g. after a torch._dynamo.reset() elsewhere in this
    # process) dispatches the ops to their fake kernels while tracing, and the profiler sees those.
    step_logits(llm.runner, prompts, [[31, 32, 33], [34, 35, 36]])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step_logits(llm.runner, prompts, [[31, 32, 33], [34, 35, 36]])
    return {event.name for event in prof.events()}


def test_the_lowerings_are_installed():
    from modelrunner_compile_inductor import lowerings

    assert lowerings.install() is True


@pytest.mark.parametrize("backend", compile_backends())
def test_compiled_steps_call_no_python_custom_op(backend, compiled_llm, eager_llm):
    llm = compiled_llm(backend)[0]
    names = _events(llm, eager_llm.get_tokenizer())
    assert not names & set(PYTHON_OPS), sorted(n for n in names if n.startswith("modelrunner::"))
    if backend == "inductor":
        # The unfrozen graphs' linear layers call oneDNN directly.
        assert "mkldnn::_linear_pointwise" in names
