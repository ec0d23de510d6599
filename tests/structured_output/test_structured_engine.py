"""Structured outputs in the engine, on tiny random-weight Llamas with SmolLM2's tokenizer: mixed
batches, padded vocabularies, compile off the step path (waiting, aborting, failing), the cache,
refusals at add time, and the backend chosen by config."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

from modelrunner import LLM, SamplingParams, StructuredOutputError
from modelrunner.errors import UnknownNameError
from modelrunner_grammar_xgrammar import XGrammarBackend

GREEDY = dict(temperature=0.0)
CHOICES = ["alpha", "beta", "gamma delta"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), device="cpu", max_model_len=256, kv_cache_memory=16 << 20, compile=False)


@pytest.fixture(scope="module")
def padded_llm(tmp_path_factory, smollm2_tokenizer, save_checkpoint) -> LLM:
    """A tiny Llama whose logits are 61 columns wider than the tokenizer's vocabulary."""
    from transformers import LlamaConfig

    tok = smollm2_tokenizer
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok) + 61, max_position_embeddings=256,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    path = save_checkpoint(config, tok, tmp_path_factory.mktemp("padded-llama"), seed=3)
    return LLM(str(path), device="cpu", max_model_len=256, kv_cache_memory=16 << 20, compile=False,
               structured_outputs_config={"backend": "xgrammar"})


def test_constrained_and_free_requests_share_a_batch(llm):
    free = SamplingParams(max_tokens=8, ignore_eos=True, **GREEDY)
    alone = [o.outputs[0].token_ids for o in llm.generate(["Hello there", "a b c"], free, use_tqdm=False)]
    params = [free, SamplingParams(max_tokens=16, structured_outputs={"choice": CHOICES}, **GREEDY),
              free, SamplingParams(max_tokens=16, structured_outputs={"regex": r"[0-9]{3}-[a-z]{2}"}, seed=1),
              SamplingParams(max_tokens=16, n=2, temperature=1.0, seed=5, structured_outputs={"choice": CHOICES})]
    outs = llm.generate(["Hello there", "pick", "a b c", "code", "pick again"], params, use_tqdm=False)
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == alone
    for out in (outs[1].outputs[0], *outs[4].outputs):
        assert out.finish_reason == "stop" and out.text in CHOICES, out
    assert outs[3].outputs[0].finish_reason == "stop" and re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[3].outputs[0].text)
    stats = llm.stats()["structured_outputs"]
    assert stats["num_compiled"] >= 2 and stats["num_cache_hits"] >= 1  # the choice grammar compiled once


def test_padding_columns_are_never_sampled(padded_llm):
    vocab = len(padded_llm.get_tokenizer())
    assert padded_llm.engine.vocab_size == vocab + 61
    outs = padded_llm.generate(["x"] * 3, [SamplingParams(max_tokens=12, temperature=1.5, seed=s,
                                                          structured_outputs={"regex": "[a-z ]{4,10}"})
                                           for s in range(3)], use_tqdm=False)
    for out in outs:
        completion = out.outputs[0]
        assert all(t < vocab for t in completion.token_ids), completion.token_ids
        assert completion.finish_reason == "stop" and re.fullmatch("[a-z ]{4,10}", completion.text), completion


def test_a_finished_grammar_ends_the_request_even_with_ignore_eos(llm):
    out = llm.generate("pick", SamplingParams(max_tokens=30, ignore_eos=True, structured_outputs={"choice": CHOICES},
                                              **GREEDY), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in CHOICES and len(out.token_ids) < 30


def test_a_feature_the_backend_lacks_is_refused_at_generate_naming_it(llm):
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(StructuredOutputError, match=r"prompt 1: .*'guidance' does not support json schema keyword "
                                                    r"'uniqueItems'") as info:
        llm.generate(["a", "b"], [SamplingParams(), SamplingParams(structured_outputs={"json": unique})],
                     use_tqdm=False)
    assert info.value.feature == "json schema keyword 'uniqueItems'"
    assert "'xgrammar' does not support json schema keyword 'uniqueItems'" in str(info.value)  # auto tried both
    with pytest.raises(StructuredOutputError, match=r"does not support this regex .*[Ll]ook"):
        llm.generate("a", SamplingParams(structured_outputs={"regex": "(?=a)b"}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing was queued


def test_auto_falls_back_to_guidance_for_what_xgrammar_lacks(llm):
    manager = llm.engine.structured_outputs
    both = {"allOf": [{"type": "integer", "minimum": 2}, {"type": "integer", "maximum": 5}]}
    assert manager.prepare(SamplingParams(structured_outputs={"json": both}).structured_outputs).backend.name \
        == "guidance"
    assert manager.prepare(SamplingParams(structured_outputs={"json": {"type": "integer"}}).structured_outputs) \
        .backend.name == "xgrammar"
    out = llm.generate("n", SamplingParams(max_tokens=8, structured_outputs={"json": both}, **GREEDY),
                       use_tqdm=False)[0].outputs[0]
    if out.finish_reason == "stop":
        assert 2 <= json.loads(out.text) <= 5


def test_an_explicit_backend_refuses_instead_of_falling_back(padded_llm):
    with pytest.raises(StructuredOutputError, match=r"'xgrammar' does not support whitespace_pattern") as info:
        padded_llm.generate("a", SamplingParams(structured_outputs={"json_object": True, "whitespace_pattern": " ?"}),
                            use_tqdm=False)
    assert info.value.backend == "xgrammar" and info.value.feature == "whitespace_pattern"


def test_an_unknown_backend_fails_at_construction(tiny_llama_dir):
    with pytest.raises(UnknownNameError, match=r"unknown grammar backend 'outlines'; installed: guidance, xgrammar"):
        LLM(str(tiny_llama_dir), device="cpu", kv_cache_memory=8 << 20, structured_outputs_config={"backend": "outlines"})


def test_requests_wait_for_their_grammar_and_can_be_aborted_or_fail(llm, monkeypatch):
    release = threading.Event()
    compile_ = XGrammarBackend.compile

    def slow_compile(self, spec):
        release.wait(10)
        if "boom" in spec.value:
            raise RuntimeError("boom")
        return compile_(self, spec)

    monkeypatch.setattr(XGrammarBackend, "compile", slow_compile)
    engine = llm.engine
    engine.add_request("free", "Hello", SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("waits", "pick", SamplingParams(max_tokens=8, structured_outputs={"choice": ["waits", "w2"]}))
    engine.add_request("aborted", "pick", SamplingParams(max_tokens=8, structured_outputs={"choice": ["ab", "cd"]}))
    engine.add_request("fails", "pick", SamplingParams(max_tokens=8, structured_outputs={"regex": "boom"}))
    finished = {}
    for _ in range(3):  # the free request runs while the grammars compile
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert "free" in finished and not {"waits", "aborted", "fails"} & set(finished)
    assert engine.abort_request("aborted")
    release.set()
    deadline = time.monotonic() + 60  # the first xgrammar compile also builds its tokenizer tables
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert finished["aborted"].outputs[0].finish_reason == "abort"
    assert finished["waits"].outputs[0].text in ("waits", "w2")
    failed = finished["fails"]
    assert failed.outputs[0].finish_reason == "error"
    assert "grammar backend 'xgrammar' failed to compile regex 'boom': RuntimeError: boom" in failed.error


def test_a_grammar_and_a_mask_that_exclude_everything_fail_that_request_only(llm):
    tok = llm.get_tokenizer()
    only = tok.encode(" zebra", add_special_tokens=False)[:1]
    bad = SamplingParams(max_tokens=4, allowed_token_ids=only, structured_outputs={"choice": CHOICES})
    outs = llm.generate(["pick", "Hello"], [bad, SamplingParams(max_tokens=3, **GREEDY)], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert "structured_outputs grammar" in outs[0].error
    assert outs[1].outputs[0].finish_reason == "length"


def test_the_compiled_grammar_cache_is_bounded_by_xgrammars_own_sizes(llm):
    """Each compiled grammar counts what xgrammar reports it takes; past ``cache_bytes`` the least
    recently used go (issue 52 item 4)."""
    import attrs

    from modelrunner.structured_output.manager import StructuredOutputManager

    engine = llm.engine
    config = attrs.evolve(engine.config.structured_outputs, backend="xgrammar", cache_bytes=200 << 10)
    manager = StructuredOutputManager(engine.executor.plugins, config, engine.structured_outputs.context)
    try:
        sizes = []
        for i in range(4):
            enum = {"type": "object", "properties": {"v": {"enum": [f"v{i}-{j}" for j in range(1000)]}}}
            compiled = manager.prepare(SamplingParams(structured_outputs={"json": enum}).structured_outputs)
            manager.wait_compiled(compiled)
            sizes.append(compiled.size)
            assert compiled.size == compiled.future.result().memory_size_bytes > 50 << 10
        stats = manager.stats()
        assert stats["cached_bytes"] <= 200 << 10 and stats["num_evicted"] >= 2, (stats, sizes)
        assert stats["cached_grammars"] == 4 - stats["num_evicted"]
    finally:
        manager.shutdown()
