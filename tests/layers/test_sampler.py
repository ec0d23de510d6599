"""The batched sampler: greedy rows, temperature, top-k / top-p, and per-row seeded generators."""

from __future__ import annotations

import pytest
import torch

from modelrunner.sampling.sampler import Sampler, SamplingMetadata, apply_top_k_top_p, sample


def _meta(rows: int, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0, generators=None):
    return SamplingMetadata.from_rows(
        [temperature] * rows, [top_k] * rows, [top_p] * rows, generators or [None] * rows
    )


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, _meta(5, temperature=0.0)), logits.argmax(-1))


def test_mixed_batch_greedy_rows_stay_greedy():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    meta = SamplingMetadata.from_rows([0.0, 1.0, 0.0, 2.0], [-1, -1, 3, 10], [1.0, 0.5, 1.0, 1.0], [None] * 4)
    out = sample(logits, meta, torch.Generator().manual_seed(0))
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
    assert out.dtype == torch.int64 and out.shape == (4,)


def test_top_k_keeps_only_the_k_most_likely():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    top_k = torch.tensor([1, 5, 0])
    cut = apply_top_k_top_p(logits, top_k, None)
    assert (cut[0] > float("-inf")).sum() == 1
    assert (cut[1] > float("-inf")).sum() == 5
    assert torch.equal(cut[2], logits[2])  # 0 = off
    assert set(cut[1].topk(5).indices.tolist()) == set(logits[1].topk(5).indices.tolist())


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    cut = apply_top_k_top_p(probs.log(), None, torch.tensor([0.7]))
    assert (cut > float("-inf")).tolist() == [[True, True, False, False]]
    cut = apply_top_k_top_p(probs.log(), None, torch.tensor([0.1]))
    assert (cut > float("-inf")).tolist() == [[True, False, False, False]]  # the top token always stays


def test_top_k_and_top_p_together():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    cut = apply_top_k_top_p(probs.log(), torch.tensor([3]), torch.tensor([0.95]))
    assert (cut > float("-inf")).tolist() == [[True, True, True, False]]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    logits = probs.log().expand(20000, 4).contiguous()
    out = sample(logits, _meta(20000), torch.Generator().manual_seed(0))
    freq = torch.bincount(out, minlength=4).float() / out.numel()
    assert torch.allclose(freq, probs, atol=0.02)
    assert freq[3] == 0


def test_low_temperature_sharpens():
    logits = torch.tensor([[2.0, 1.0, 0.0]]).expand(4000, 3).contiguous()
    cold = sample(logits, _meta(4000, temperature=0.1), torch.Generator().manual_seed(0))
    hot = sample(logits, _meta(4000, temperature=5.0), torch.Generator().manual_seed(0))
    assert (cold == 0).float().mean() > 0.99
    assert (hot == 0).float().mean() < 0.6


def test_seeded_row_is_independent_of_the_batch():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3))
    alone = sample(logits[2:3], _meta(1, generators=[torch.Generator().manual_seed(42)]))
    gens = [None, None, torch.Generator().manual_seed(42), None, torch.Generator().manual_seed(7), None]
    batched = sample(logits, _meta(6, generators=gens), torch.Generator().manual_seed(99))
    assert batched[2] == alone[0]


def test_same_seed_same_tokens_different_seed_differs():
    logits = torch.zeros(1, 1000)  # uniform: any difference comes from the noise

    def draw(seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return [int(sample(logits, _meta(1, generators=[g]))[0]) for _ in range(20)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_sampler_shared_generator_is_reproducible():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(4))
    a = Sampler(seed=5)(logits, _meta(3))
    b = Sampler(seed=5)(logits, _meta(3))
    assert torch.equal(a, b)


def test_bad_shapes_and_lengths_are_clear_errors():
    with pytest.raises(ValueError, match="num_rows=2"):
        sample(torch.zeros(3, 10), _meta(2))
    with pytest.raises(ValueError, match="equal lengths"):
        SamplingMetadata.from_rows([1.0], [0, 0], [1.0], [None])


def test_the_inverse_transform_never_draws_a_token_of_zero_weight_at_either_end():
    # One uniform a row against the running sum: u = 0 takes the first token of positive weight, u just
    # below 1 the last one (a float32 product that rounds up to the total must not run past it).
    from modelrunner.sampling.sampler import _inverse_cdf

    weights = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0, 0.0]] * 3)
    u = torch.tensor([0.0, 1.0 - 2**-24, 0.3])
    assert _inverse_cdf(weights.clone(), u).tolist() == [1, 3, 3]
    huge = torch.tensor([[0.0, 3e38, 3e38 * 0.1, 0.0]])  # a total near float32's largest
    assert _inverse_cdf(huge.clone(), torch.tensor([1.0 - 2**-24])).tolist() == [2]
