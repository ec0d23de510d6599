"""Issue 2's end-to-end promise on the real model: greedy text equals transformers' own generate.

Run through the public API twice: with every installed plugin (the native Llama adapter wins) and
with none (``MODELRUNNER_PLUGINS=""``: the kernel's generic transformers adapter).
"""

from __future__ import annotations

import pytest
import torch

from modelrunner import LLM, ModelRunner, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:",
]
NEW_TOKENS = 32

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    """transformers' greedy continuations of every prompt, one prompt at a time, up to and including EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    out = {}
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt").input_ids
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, attention_mask=torch.ones_like(ids))
            out[prompt] = gen[0, ids.shape[1]:].tolist()
    assert any(len(ids) < NEW_TOKENS for ids in out.values()), "no prompt exercises the EOS stop"
    return out


@pytest.mark.parametrize("allow", [None, ""], ids=["installed-adapters", "generic-adapter"])
def test_greedy_is_token_identical_to_transformers(reference, allow, monkeypatch):
    if allow is not None:
        monkeypatch.setenv("MODELRUNNER_PLUGINS", allow)
    llm = LLM(model="smollm2")
    expected_adapter = "default-transformers" if allow == "" else "llama"
    assert llm.runner.loaded.adapter == expected_adapter
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt == prompt
        assert out.outputs[0].token_ids == reference[prompt], prompt
        stopped = len(reference[prompt]) < NEW_TOKENS
        assert out.outputs[0].finish_reason == ("stop" if stopped else "length")


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    llm = LLM(model="smollm2")
    params = dict(temperature=0.9, top_p=0.95, top_k=50, max_tokens=24, ignore_eos=True)
    first = llm.generate(PROMPTS[:2], SamplingParams(seed=7, **params), use_tqdm=False)
    again = llm.generate(PROMPTS[:2], SamplingParams(seed=7, **params), use_tqdm=False)
    other = llm.generate(PROMPTS[:2], SamplingParams(seed=8, **params), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    assert [o.outputs[0].token_ids for o in first] != [o.outputs[0].token_ids for o in other]


def test_article_runner_api_forward_and_generate(smollm2_dir, reference):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    runner = ModelRunner({"model": "smollm2", "dtype": "float32"})
    loaded = runner.load_model()
    assert runner.load_model() is loaded  # idempotent
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    ids = tok(PROMPTS[0], return_tensors="pt").input_ids
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf(ids).logits
    ours = runner.forward(ids)
    assert ours.shape == expected.shape
    assert (ours - expected).abs().max().item() < 1e-4
    new = runner.generate(ids[0], max_new_tokens=8)
    assert new.tolist() == reference[PROMPTS[0]][:8]
    ragged = runner.generate([tok(p).input_ids for p in PROMPTS[:2]], max_new_tokens=4)
    assert [t.tolist() for t in ragged] == [reference[p][:4] for p in PROMPTS[:2]]
    assert runner.scratch_allocator().stats().used_blocks == 0
