"""vLLM's sampling fields, each against a reference written here (a per-sequence loop over the same
logits), mixed in one batch with requests that use none of them; log-probabilities against
transformers; beam search against transformers' beam search."""

from __future__ import annotations

import math

import pytest
import torch

from modelrunner import LLM, BeamSearchParams, SamplingParams
from modelrunner.engine.sequence import child_seed
from modelrunner.sampling.sampler import SamplingMetadata, sample

NEW = 6
PROMPTS = [[791, 6037, 282, 4649, 314], [8630, 2573, 253, 655], [33, 28, 216, 34, 28, 216, 35]]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), device="cpu", max_model_len=128, kv_cache_memory=16 << 20)


def _penalties(logits, prompt, out, p):
    logits = logits.clone()
    for token in set(prompt) | set(out):
        if p.repetition_penalty != 1.0:
            value = logits[token]
            logits[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
    for token in set(out):
        logits[token] -= p.frequency_penalty * out.count(token) + p.presence_penalty
    return logits


def _bias(logits, prompt, out, p):
    logits = logits.clone()
    for token, bias in p.logit_bias.items():
        logits[token] += bias
    return logits


def _allowed(logits, prompt, out, p):
    keep = torch.full_like(logits, float("-inf"))
    keep[list(p.allowed_token_ids)] = 0.0
    return logits + keep


def _bad_words(tokenizer):
    def apply(logits, prompt, out, p):
        logits = logits.clone()
        for word in p.bad_words:
            for text in (word, " " + word):
                ids = tokenizer.encode(text, add_special_tokens=False)
                if len(ids) == 1 or out[len(out) - len(ids) + 1:] == ids[:-1]:
                    logits[ids[-1]] = float("-inf")
        return logits
    return apply


def _reference(llm, prompt, params, process):
    """The request alone, step by step: the model's logits of the whole sequence, the field applied
    by ``process``, then the kernel's sampler with the request's own generator."""
    generator = None if params.seed is None else torch.Generator().manual_seed(child_seed(params.seed, 0))
    out: list[int] = []
    for _ in range(params.max_tokens):
        logits = llm.runner.forward(prompt + out)[0, -1]
        logits = process(logits, prompt, out, params)
        # min_p is the reference's own (_min_p), never the sampler's: the sampler gets 0.
        meta = SamplingMetadata.from_rows([params.temperature], [params.top_k], [params.top_p], [generator], [0.0])
        out.append(int(sample(logits[None], meta)[0]))
    return out


def _min_p(logits, prompt, out, p):
    """vLLM's min-p: tokens whose probability (after temperature) is below ``min_p`` × the top one's are dropped."""
    probs = (logits / p.temperature).softmax(-1)
    return logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))


CASES = {
    "repetition_penalty": (dict(repetition_penalty=1.8), _penalties),
    "presence_penalty": (dict(presence_penalty=1.5), _penalties),
    "frequency_penalty": (dict(frequency_penalty=1.2, presence_penalty=-0.3), _penalties),
    "logit_bias": (dict(logit_bias={17: 8.0, 4000: 5.5, 9: -100}), _bias),
    "allowed_token_ids": (dict(allowed_token_ids=[17, 4000, 9, 100, 2000]), _allowed),
}


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
@pytest.mark.parametrize("case", list(CASES))
def test_each_field_matches_a_per_sequence_reference_in_a_mixed_batch(llm, case, temperature):
    fields, process = CASES[case]
    params = SamplingParams(max_tokens=NEW, temperature=temperature, seed=11, ignore_eos=True, **fields)
    plain = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [params, plain, params], use_tqdm=False)
    for prompt, out in zip(PROMPTS[::2], outs[::2]):
        assert out.outputs[0].token_ids == _reference(llm, prompt, params, process), case
    assert outs[1].outputs[0].token_ids == _reference(llm, PROMPTS[1], plain, lambda lg, *a: lg)


def test_bad_words_match_the_reference(llm):
    tokenizer = llm.get_tokenizer()
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    base = llm.generate([{"prompt_token_ids": PROMPTS[0]}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    words = [tokenizer.decode([base[0]]).strip(), tokenizer.decode(base[2:4]).strip()]
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, bad_words=words)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}], [params, greedy],
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == _reference(llm, PROMPTS[0], params, _bad_words(tokenizer))
    assert out[0].outputs[0].token_ids != base


def test_min_p_keeps_only_tokens_near_the_top(llm):
    params = SamplingParams(max_tokens=NEW, temperature=1.0, min_p=0.3, seed=5, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPTS[2]}], params, use_tqdm=False)[0].outputs[0].token_ids
    sequence = PROMPTS[2]
    for token in out:
        probs = llm.runner.forward(sequence)[0, -1].softmax(-1)
        assert probs[token] >= 0.3 * probs.max()  # min-p never picks a token below its floor
        sequence = sequence + [token]
    assert out == _reference(llm, PROMPTS[2], params, _min_p)


def test_logprobs_equal_log_softmax_of_transformers_logits(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    llm = LLM(str(smollm2_dir), device="cpu", max_model_len=256, kv_cache_memory=64 << 20)
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompt = tokenizer("The capital of France is").input_ids
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, prompt_logprobs=3)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    generated = out.outputs[0].token_ids
    reference = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([prompt + generated])).logits[0].float(), -1)
    cumulative = 0.0
    for i, (token, entry) in enumerate(zip(generated, out.outputs[0].logprobs)):
        row = expected[len(prompt) - 1 + i]
        assert token in entry and entry[token].rank == 1  # greedy: the chosen token is the most likely
        top = row.topk(5)
        assert set(entry) == set(top.indices.tolist())
        for tid, logprob in entry.items():
            assert abs(logprob.logprob - row[tid].item()) <= 1e-4
            assert logprob.rank == int((row > row[tid]).sum()) + 1
            assert logprob.decoded_token == tokenizer.decode([tid])
        cumulative += entry[token].logprob
    assert math.isclose(out.outputs[0].cumulative_logprob, cumulative, abs_tol=1e-5)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry, row, token = out.prompt_logprobs[position], expected[position - 1], prompt[position]
        assert token in entry and abs(entry[token].logprob - row[token].item()) <= 1e-4
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        assert set(row.topk(3).indices.tolist()) <= set(entry)
    metrics = out.metrics
    assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time <= metrics.finished_time
    assert metrics.time_to_first_token > 0 and metrics.time_per_output_token > 0


def test_sampled_tokens_always_carry_their_logprob(llm):
    params = SamplingParams(max_tokens=NEW, temperature=1.5, seed=3, logprobs=1, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": PROMPTS[1]}, params, use_tqdm=False)[0].outputs[0]
    assert all(token in entry and len(entry) in (1, 2) for token, entry in zip(out.token_ids, out.logprobs))


def test_beam_search_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)  # peaked distributions: beams differ clearly
    model.save_pretrained(str(tmp_path))
    prompts = [[5, 9, 2, 77, 31], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]]
    llm = LLM(str(tmp_path), device="cpu", block_size=4, kv_cache_memory=4 << 20)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=4, max_tokens=7, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ref = model.generate(torch.tensor([prompt]), num_beams=4, num_return_sequences=4, do_sample=False,
                             eos_token_id=None, max_new_tokens=7, min_new_tokens=7, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
        assert [s.generated_tokens for s in out.sequences] == ref.sequences[:, len(prompt):].tolist()
        scores = [s.score(1.0) for s in out.sequences]
        assert max(abs(a - b) for a, b in zip(scores, ref.sequences_scores.tolist())) <= 1e-4
    assert llm.engine.allocator.stats().used_blocks == 0
