"""Every installed compile backend computes what eager computes: logits within 1e-4, identical greedy text."""

from __future__ import annotations

import pytest
import torch

from .helpers import NEW_TOKENS, PROMPTS, compile_backends, step_logits

BACKENDS = compile_backends()


def test_the_real_backends_are_installed():
    assert {"inductor", "aot"} <= set(BACKENDS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_text_matches_eager(backend, compiled_llm, eager_texts):
    texts = compiled_llm(backend)[2]
    assert texts == eager_texts
    assert all(text for text in texts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_match_eager_within_1e_4(backend, compiled_llm, eager_llm):
    llm = compiled_llm(backend)[0]
    tokenizer = eager_llm.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    # Decode inputs fixed up front so both runs see the same tokens; 18 steps cross a block boundary.
    decode = [[100 + 7 * step + row for row in range(len(prompts))] for step in range(NEW_TOKENS - 2)]
    expected = step_logits(eager_llm.runner, prompts, decode)
    actual = step_logits(llm.runner, prompts, decode)
    assert len(actual) == len(expected) == 1 + len(decode)
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == torch.float32 and a.shape == e.shape == (len(prompts), llm.runner.loaded.vocab_size)
        diff = (a - e).abs().max().item()
        assert diff <= 1e-4, f"{backend}: step {step} logits differ from eager by {diff:.2e}"
