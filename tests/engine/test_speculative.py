"""Speculative decoding is exact: whatever the proposer proposes, greedy outputs are those of plain
decoding, through preemption, stop conditions inside accepted runs, logprobs and n > 1.

The model-free FakeRunner (conftest.py) reads each row's context back through the block tables, so
a draft's KV in a wrong slot, or a rejected draft left in the cache, changes the tokens. The tiny
random Llama repeats itself, so ``ngram`` proposals get accepted there.
"""

from __future__ import annotations

import random
import re

import pytest

from modelrunner import LLM
from modelrunner.config import RunnerConfig
from modelrunner.engine import LLMEngine, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": None}  # every step drafts: the counts asserted must not depend on timing


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 8) for _ in range(rng.randrange(4, 20))] for _ in range(count)]


def _run(engine: LLMEngine, prompts, params) -> list:
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("bad, message", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer, got 0"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min (4) must not exceed prompt_lookup_max (2)"),
    ({"num_speculative_tokens": 2, "lookahead": 1}, "unknown speculative_config key 'lookahead'"),
    ({"method": "draft"}, "method 'draft' needs 'model'"),
    ("ngram", "speculative_config must be a dict"),
    ({"disable_by_batch_size": 0}, "disable_by_batch_size must be a positive integer, 'auto' or None, got 0"),
])
def test_bad_speculative_config_is_refused_by_name(bad, message):
    with pytest.raises(ValueError) as info:
        RunnerConfig.from_dict({"model": "x", "speculative_config": bad})
    assert message in str(info.value)


def test_vllm_config_is_accepted():
    config = RunnerConfig.from_dict({"model": "x", "speculative_config": {"method": "ngram", "num_speculative_tokens": 5,
                                                                          "prompt_lookup_min": 2, "prompt_lookup_max": 4}})
    assert (config.speculative.num_speculative_tokens, config.speculative.prompt_lookup_min) == (5, 2)
    assert RunnerConfig.from_dict({"model": "x", "speculative_config": {"model": "/d"}}).speculative.method == "draft"


def test_unknown_method_names_the_installed_proposers(fake_runner):
    with pytest.raises(ValueError, match=r"unknown method 'eagle'; installed proposers: .*ngram"):
        LLMEngine(fake_runner(speculative_config={"method": "eagle"}))


def test_garbage_proposals_change_nothing_even_under_preemption(fake_runner):
    """Random, too long, out-of-vocabulary and non-list proposals; a KV budget that forces preemption;
    stop tokens and max_tokens; n = 2; logprobs: every output is plain decoding's."""
    prompts = _prompts(8)
    params = [SamplingParams(max_tokens=6 + 3 * i, logprobs=2 if i % 3 == 0 else None,
                             stop_token_ids=[5] if i % 4 == 1 else None, n=2 if i == 2 else 1, **GREEDY)
              for i in range(8)]
    kw = dict(num_blocks=24, block_size=4)
    plain = _run(LLMEngine(fake_runner(**kw)), prompts, params)
    engine = LLMEngine(fake_runner(**kw, speculative_config={"method": "garbage", "num_speculative_tokens": 4,
                                                       "disable_by_batch_size": None}))
    spec = _run(engine, prompts, params)
    for a, b in zip(plain, spec):
        assert [(c.token_ids, c.finish_reason) for c in a.outputs] == [(c.token_ids, c.finish_reason)
                                                                        for c in b.outputs]
        for ca, cb in zip(a.outputs, b.outputs):
            if ca.logprobs is not None:
                assert [{t: round(v.logprob, 4) for t, v in pos.items()} for pos in ca.logprobs] == \
                       [{t: round(v.logprob, 4) for t, v in pos.items()} for pos in cb.logprobs]
    stats = engine.speculator.stats()  # (the fake executor has no stats() of its own)
    assert stats["num_draft_tokens"] > 50 and stats["proposals_out_of_vocab"] > 0  # ids outside cut, and counted
    assert engine.allocator.stats().used_blocks == 0 and engine.scheduler.num_preemptions > 0


def test_drafting_stops_at_batch_sizes_where_it_measured_slower():
    from modelrunner_speculative import StepCost

    cost = StepCost()
    explored = []
    for _ in range(8):  # each step asks, runs, and reports its cost
        explored.append(cost.drafting())
        cost.observe(explored[-1], 3e-3 if explored[-1] else 2e-3)  # drafting: 3 ms per token, plain: 2 ms
    assert explored == [True, False] * 4  # both kinds measured, alternating
    later = [cost.drafting() for _ in range(128)]
    assert sum(later) == 2  # only the re-probes (one step in 64) draft
    for _ in range(12):
        cost.observe(True, 1e-3)  # the text changed: drafting now pays
    assert cost.drafting() and cost.drafting()


def test_a_fixed_disable_by_batch_size_drafts_only_below_it(fake_runner):
    prompts, params = _prompts(6), SamplingParams(max_tokens=12, **GREEDY)
    engine = LLMEngine(fake_runner(num_blocks=64, block_size=4, speculative_config={
        "method": "garbage", "num_speculative_tokens": 2, "disable_by_batch_size": 4}))
    _run(engine, prompts[:3], [params] * 3)
    assert engine.speculator.stats()["num_drafts"] > 0
    before = engine.speculator.stats()["num_drafts"]
    _run(engine, prompts, [params] * 6)  # six decode together, from the same step to the same end
    assert engine.speculator.stats()["num_drafts"] == before


@pytest.fixture(scope="module")
def tiny_llms(tmp_path_factory, smollm2_tokenizer, save_checkpoint):
    """A tiny random Llama with tied embeddings, which repeats a token for a while then switches:
    ``ngram`` proposals are accepted in runs and rejected at the switches."""
    from transformers import LlamaConfig

    tok = smollm2_tokenizer
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=512,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         tie_word_embeddings=True, initializer_range=0.05, architectures=["LlamaForCausalLM"])
    path = save_checkpoint(config, tok, tmp_path_factory.mktemp("tiny-tied-llama"))
    kw = dict(device="cpu", dtype="float32", max_model_len=256, kv_cache_memory=4 * 2**20, block_size=8)
    return LLM(str(path), **kw), LLM(str(path), **kw, speculative_config=NGRAM), path


def test_ngram_greedy_is_plain_decoding_with_stops_and_logprobs(tiny_llms):
    plain, spec, _ = tiny_llms
    tok = plain.get_tokenizer()
    prompts = ["one two three one two three one two", "a b c d a b c d a b", "hello hello hello",
               "The cat sat on the mat. The cat sat", "1 2 3 4 5 6", "x y x y x y", "to be or not to be",
               "red green blue red green"]
    first = plain.generate(prompts, SamplingParams(max_tokens=24, **GREEDY), use_tqdm=False)
    stop_word = tok.decode(first[0].outputs[0].token_ids[10:12])
    params = [SamplingParams(max_tokens=24, **GREEDY),
              SamplingParams(max_tokens=17, logprobs=3, **GREEDY),
              SamplingParams(max_tokens=24, stop=[stop_word] if stop_word.strip() else None, **GREEDY),
              SamplingParams(max_tokens=24, logit_bias={7: 1.0}, **GREEDY),  # a logits processor: does not speculate
              SamplingParams(max_tokens=9, **GREEDY),
              SamplingParams(max_tokens=24, n=2, **GREEDY),
              SamplingParams(max_tokens=24, stop_token_ids=[first[6].outputs[0].token_ids[5]], **GREEDY),
              SamplingParams(max_tokens=24, **GREEDY)]
    params[0] = SamplingParams(max_tokens=24, stop=[stop_word], **GREEDY) if stop_word.strip() else params[0]
    a = plain.generate(prompts, params, use_tqdm=False)
    b = spec.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert [(c.token_ids, c.text, c.finish_reason) for c in x.outputs] == \
               [(c.token_ids, c.text, c.finish_reason) for c in y.outputs]
        if x.outputs[0].logprobs is not None:
            for px, py in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
                assert px.keys() == py.keys()
                assert all(abs(px[t].logprob - py[t].logprob) < 1e-4 for t in px)
    assert b[3].metrics.spec_num_drafts == 0  # logit_bias: decoded one token at a time
    accepted = sum(o.metrics.spec_num_accepted_tokens for o in b)
    assert accepted > 20, accepted
    m = b[7].metrics
    assert m.spec_num_draft_tokens >= m.spec_num_accepted_tokens > 0
    assert m.spec_acceptance_rate == m.spec_num_accepted_tokens / m.spec_num_draft_tokens
    stats = spec.llm_engine.stats()["speculative"]
    assert stats["num_accepted_tokens"] >= accepted and 0 < stats["acceptance_rate"] <= 1
    assert spec.memory_stats()["used_blocks"] == 0


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_structured_outputs_speculate_and_keep_plain_decodings_tokens(tiny_llms, backend):
    """Each verified position is masked by the grammar's state there; a draft token the grammar refuses
    ends the draft, and the matcher is back where it was for the tokens actually appended."""
    _, _, path = tiny_llms
    kw = dict(device="cpu", dtype="float32", max_model_len=256, kv_cache_memory=4 * 2**20, block_size=8,
              structured_outputs_config={"backend": backend})
    prompts = ["ab ab ab ab ab ab", "1, 2, 3, 1, 2, 3, 1, 2,", "x y x y x y", "red green red green red",
               "yes no yes no yes"]
    constraints = [{"regex": "(ab ){8}ab"}, {"regex": "([0-9], ){12}[0-9]"}, {"regex": "[xy ]{10,40}"},
                   {"json": {"type": "object", "properties": {"colors": {"type": "array", "items": {
                       "enum": ["red", "green"]}, "minItems": 6, "maxItems": 6}}, "required": ["colors"]}},
                   {"choice": ["yes no yes no yes no", "yes yes", "no"]}]
    params = [SamplingParams(max_tokens=48, temperature=0.0, logprobs=2 if i == 1 else None, structured_outputs=c)
              for i, c in enumerate(constraints)]
    want = LLM(str(path), **kw).generate(prompts, params, use_tqdm=False)
    got = LLM(str(path), **kw, speculative_config=NGRAM).generate(prompts, params, use_tqdm=False)
    for x, y in zip(want, got):
        assert (y.outputs[0].token_ids, y.outputs[0].finish_reason) == (x.outputs[0].token_ids,
                                                                         x.outputs[0].finish_reason)
    assert [lp.keys() for lp in got[1].outputs[0].logprobs] == [lp.keys() for lp in want[1].outputs[0].logprobs]
    assert re.fullmatch("(ab ){8}ab", got[0].outputs[0].text)
    assert sum(o.metrics.spec_num_accepted_tokens for o in got) > 10, [o.metrics for o in got]


def test_prefix_cache_holds_only_accepted_tokens(tiny_llms):
    """A second request whose prompt is the first's prompt plus output reuses the cached blocks, and
    gets exactly what plain decoding gives it: no rejected draft's KV was ever registered."""
    plain, spec, _ = tiny_llms
    p = SamplingParams(max_tokens=40, **GREEDY)
    first = spec.generate("a b c a b c a b c", p, use_tqdm=False)[0]
    follow = first.prompt_token_ids + first.outputs[0].token_ids
    again = spec.generate({"prompt_token_ids": follow}, SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0]
    want = plain.generate({"prompt_token_ids": follow}, SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0]
    assert again.num_cached_tokens >= 32
    assert again.outputs[0].token_ids == want.outputs[0].token_ids


def test_sampling_with_speculation_is_seeded_and_valid(tiny_llms):
    _, spec, _ = tiny_llms
    p = SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=3)
    runs = [spec.generate(["x y x y x y"] * 2, p, use_tqdm=False) for _ in range(2)]
    assert [o.outputs[0].token_ids for o in runs[0]] == [o.outputs[0].token_ids for o in runs[1]]
    assert all(len(o.outputs[0].token_ids) == 20 for o in runs[0])


def test_draft_model_greedy_is_plain_decoding(tiny_llms, tiny_llama_dir):
    """The target as its own draft accepts nearly everything (its KV bookkeeping is right); a random
    draft of the same vocabulary accepts little; both give plain decoding's outputs."""
    plain, _, path = tiny_llms
    kw = dict(device="cpu", dtype="float32", max_model_len=256, kv_cache_memory=4 * 2**20, block_size=8)
    prompts = ["one two three", "a b c d", "hello there", "x y z"]
    params = [SamplingParams(max_tokens=14 + i, **GREEDY) for i in range(4)]
    params[1] = SamplingParams(max_tokens=15, logit_bias={5: 1.0}, **GREEDY)  # does not speculate
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    for draft, least in ((path, 0.9), (tiny_llama_dir, 0.0)):
        llm = LLM(str(path), **kw, speculative_config={"model": str(draft), "num_speculative_tokens": 3,
                                                    "disable_by_batch_size": None})
        got = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
        stats = llm.llm_engine.stats()["speculative"]
        assert stats["method"] == "draft" and stats["num_drafts"] > 0
        assert stats["acceptance_rate"] >= least, stats
        assert stats["draft_kv_used_blocks"] == 0  # every finished sequence's draft KV was given back


def test_draft_with_another_vocabulary_is_refused(tiny_llms, tmp_path):
    from modelrunner_kit.conformance.models import tiny_checkpoint

    _, _, path = tiny_llms
    other = tiny_checkpoint("LlamaForCausalLM", tmp_path)  # a 256-token vocabulary
    with pytest.raises(ValueError, match=r"cannot propose for this target: its vocabulary has 256 tokens"):
        LLM(str(path), device="cpu", dtype="float32", max_model_len=256, kv_cache_memory=4 * 2**20,
            speculative_config={"model": str(other), "num_speculative_tokens": 2})


def test_fruitless_proposals_turn_speculation_down(fake_runner):
    """Garbage is (nearly) never accepted: after three misses in a row a sequence pauses 2, 4, 8 …
    steps, so 120 tokens cost far fewer verifications than steps."""
    engine = LLMEngine(fake_runner(num_blocks=64, block_size=4, max_model_len=160,
                                   speculative_config={"method": "garbage", "num_speculative_tokens": 4,
                                                       "disable_by_batch_size": None}))
    out = _run(engine, [[1, 2, 3]], [SamplingParams(max_tokens=120, **GREEDY)])[0]
    assert len(out.outputs[0].token_ids) == 120
    assert out.metrics.spec_num_drafts < 25, out.metrics
    assert out.metrics.spec_num_draft_tokens < 40, out.metrics
