"""A victim stream's time per output token alone, and beside one request at the largest size each
:class:`~modelrunner.config.RequestLimits` limit accepts (``allowed_token_ids``, ``logit_bias``,
``stop_token_ids``, stop strings, bad words, all of them at once), on a 2-layer random Llama with
SmolLM2's 49,152-token vocabulary, where the sampling side dominates a step. Prints each ratio to
the victim alone (target: at most 2x; a plain request beside it is the peer that shows what a second
row costs by itself). Both streams are greedy, so what is measured is the fields' cost, not the
sampler's random draws. Medians over the victim's steps; under a minute.

    python bench/request_limits.py
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time

import torch

from modelrunner import LLM, SamplingParams
from modelrunner.config import RequestLimits

VICTIM_TOKENS = 32
"""Output tokens of the victim stream (the first few, prefill included, are not timed)."""
ROUNDS = 3
"""Alone/beside pairs per case (the machine may be shared: each ratio compares neighbours in time)."""


def tiny_llama(directory: str) -> str:
    """A 2-layer random Llama with SmolLM2's tokenizer, saved to ``directory``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from modelrunner.loading.source import resolve_source

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_source("smollm2").directory))
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def heavy_requests(vocab: int, limits: RequestLimits) -> dict[str, dict]:
    """Sampling fields of one request per limit, each at the largest size it accepts."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"

    def text(n: int) -> str:
        return "".join(rng.choice(letters) for _ in range(n))

    never = vocab - 1  # a stop id the random model is unlikely to produce; repeats are accepted
    cases = {
        "allowed_token_ids": {"allowed_token_ids": list(range(limits.max_allowed_token_ids or vocab))},
        "logit_bias": {"logit_bias": {t: 0.01 for t in range(limits.max_logit_bias or vocab)}},
        "stop_token_ids": {"stop_token_ids": [never] * (limits.max_stop_token_ids or vocab),
                           "min_tokens": VICTIM_TOKENS},
        "stop": {"stop": [text(limits.max_stop_string_chars) for _ in range(limits.max_stop_strings)]},
        "bad_words": {"bad_words": [text(limits.max_bad_word_chars) for _ in range(limits.max_bad_words)]},
    }
    cases["all at once"] = {k: v for fields in cases.values() for k, v in fields.items()}
    return cases


def victim_time_per_token(llm: LLM, heavy: dict | None) -> float:
    """Median seconds between the victim's output tokens beside a request with ``heavy`` fields (None: alone)."""
    engine = llm.engine
    engine.add_request("victim", "Once upon a time", SamplingParams(temperature=0.0, ignore_eos=True,
                                                                    max_tokens=VICTIM_TOKENS))
    if heavy is not None:
        engine.add_request("heavy", "The quick brown fox", SamplingParams(temperature=0.0, ignore_eos=True,
                                                                          max_tokens=VICTIM_TOKENS + 8, **heavy))
    stamps: list[float] = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id == "heavy" and out.finished and out.error:
                raise RuntimeError(f"the heavy request failed: {out.error}")
            if out.request_id == "victim" and out.outputs[0].delta_token_ids:
                stamps.append(now)
    gaps = [b - a for a, b in zip(stamps[2:], stamps[3:])]
    return statistics.median(gaps)


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as directory:
        llm = LLM(tiny_llama(directory), device="cpu", max_model_len=512, kv_cache_memory=64 << 20)
        vocab = llm.engine.vocab_size
        limits = llm.engine.config.limits
        victim_time_per_token(llm, None)  # warm-up
        print(f"victim: {VICTIM_TOKENS} greedy tokens, vocabulary {vocab}, 1 torch thread; each case is timed "
              f"right after the victim alone, {ROUNDS} rounds, median ratio")
        rows = [("a plain request (peer)", {})] + list(heavy_requests(vocab, limits).items())
        for name, fields in rows:
            pairs = [(victim_time_per_token(llm, None), victim_time_per_token(llm, fields)) for _ in range(ROUNDS)]
            alone = statistics.median(a for a, _ in pairs)
            beside = statistics.median(b for _, b in pairs)
            ratio = statistics.median(b / a for a, b in pairs)
            print(f"beside {name:<24} alone {alone * 1e3:6.2f} ms/token, beside {beside * 1e3:6.2f} ms/token: "
                  f"{ratio:5.2f}x")


if __name__ == "__main__":
    main()
