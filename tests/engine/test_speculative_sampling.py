"""Rejection sampling keeps the target distribution: histograms of speculative and plain sampling
agree (chi-square, p > 0.01), on the sampler function over 20,000 draws per case and on the engine."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from modelrunner import SamplingParams
from modelrunner.spec_decode import greedy_accept, rejection_sample


def chi_square_p(observed: list[int], expected: list[float]) -> float:
    """Goodness-of-fit p-value, bins with an expected count under 5 merged into one."""
    small = [i for i, e in enumerate(expected) if e < 5]
    obs = [o for i, o in enumerate(observed) if i not in small] + [sum(observed[i] for i in small)]
    exp = [e for i, e in enumerate(expected) if i not in small] + [sum(expected[i] for i in small)]
    if exp[-1] == 0:
        assert obs[-1] == 0, "a token of probability 0 was drawn"
        obs, exp = obs[:-1], exp[:-1]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return float(torch.special.gammaincc(torch.tensor((len(exp) - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _target(seed: int, vocab: int = 40, scale: float = 2.0, keep: int | None = None) -> torch.Tensor:
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale
    if keep is not None:  # a top-k cut: most tokens have probability 0
        logits[logits.argsort(descending=True)[keep:]] = float("-inf")
    return logits.softmax(-1)


@pytest.mark.parametrize("case, n", [("likely-draft", 20_000), ("unlikely-draft", 5_000), ("top-k", 5_000),
                                     ("draft-distribution", 5_000)])
def test_first_token_is_distributed_as_the_target(case, n):
    p = _target(1, keep=8 if case == "top-k" else None)
    order = p.argsort(descending=True).tolist()
    draft = {"likely-draft": order[0], "unlikely-draft": order[5], "top-k": order[-1],  # probability 0
             "draft-distribution": order[1]}[case]
    q = _target(2, scale=1.0).view(1, -1) if case == "draft-distribution" else None
    probs = torch.stack([p, _target(3)])
    generator = torch.Generator().manual_seed(0)
    if q is not None:  # the draft token drawn from q, as a draft model would
        drafts = torch.multinomial(q[0], n, replacement=True, generator=generator).tolist()
    else:
        drafts = [draft] * n
    counts = Counter(rejection_sample(probs, [d], generator, q)[0] for d in drafts)
    pvalue = chi_square_p([counts[t] for t in range(len(p))], (p * n).tolist())
    assert pvalue > 0.01, (case, pvalue)


def test_second_token_follows_the_bonus_row_after_an_accepted_draft():
    n = 5_000
    p0 = torch.zeros(40)
    p0[7] = 1.0  # the draft is certain: always accepted, the next token comes from the bonus row
    p1 = _target(4)
    generator = torch.Generator().manual_seed(1)
    counts = Counter()
    for _ in range(n):
        out = rejection_sample(torch.stack([p0, p1]), [7], generator)
        assert out[0] == 7 and len(out) == 2
        counts[out[1]] += 1
    assert chi_square_p([counts[t] for t in range(40)], (p1 * n).tolist()) > 0.01


def test_greedy_accepts_the_matching_prefix_then_the_target_token():
    assert greedy_accept([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
    assert greedy_accept([5, 6, 7, 8], [5, 9, 7]) == [5, 6]
    assert greedy_accept([5, 6], [4]) == [5]


def test_engine_sampling_histogram_matches_plain(fake_runner):
    """2,000 seeded requests of 3 tokens with and without ``ngram`` on the model-free runner (its
    prompt holds every token, so every second token is proposed for): the second tokens agree."""
    from modelrunner.engine import LLMEngine

    n = 2000
    prompt = list(range(1, 64))
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=i, ignore_eos=True) for i in range(n)]

    def second_tokens(**spec) -> tuple[Counter, LLMEngine]:
        engine = LLMEngine(fake_runner(num_blocks=4096, block_size=16, max_num_seqs=256, max_model_len=80, **spec))
        return Counter(_second(engine, prompt, params)), engine

    plain, _ = second_tokens()
    spec, engine = second_tokens(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                          "disable_by_batch_size": None})
    stats = engine.speculator.stats()
    assert stats["num_drafts"] >= n * 0.9 and stats["num_accepted_tokens"] > 0, stats
    tokens = sorted(set(plain) | set(spec))
    pooled = [(plain[t] + spec[t]) / (2 * n) for t in tokens]
    p = chi_square_p([spec[t] for t in tokens], [n * f for f in pooled])
    assert p > 0.01, p


def _second(engine, prompt, params) -> list[int]:
    done = {}
    for i, p in enumerate(params):
        engine.add_request(str(i), prompt, p, on_output=engine.collect(done))
    while len(done) < len(params):
        engine.advance()
    return [done[str(i)].outputs[0].token_ids[1] for i in range(len(params))]
