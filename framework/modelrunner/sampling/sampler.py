"""The batched sampler: one call picks the next token of every sampled row, each with its own rules."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from ..layers.cpu_ops import argmax_rows
from .params import SAMPLING_EPS

_TOP_K_CAP = 2**31 - 1  # any top_k at least the vocabulary means "all tokens"


@attrs.frozen
class SamplingMetadata:
    """Per-row sampling parameters for one step, as tensors (build with :meth:`from_rows`)."""

    temperature: torch.Tensor
    """[S] float32; 0 marks a greedy row."""
    top_k: torch.Tensor | None
    """[S] int64, 0 = off; None when no row uses top-k."""
    top_p: torch.Tensor | None
    """[S] float32, 1 = off; None when no row uses top-p."""
    min_p: torch.Tensor | None
    """[S] float32, 0 = off; None when no row uses min-p."""
    generators: tuple[torch.Generator | None, ...]
    """Each row's own generator (seeded requests) or None to use the shared one."""
    all_greedy: bool
    """Every row is greedy (then sampling is a plain argmax)."""
    any_greedy: bool
    """At least one row is greedy."""

    @classmethod
    def from_rows(
        cls,
        temperatures: Sequence[float],
        top_ks: Sequence[int],
        top_ps: Sequence[float],
        generators: Sequence[torch.Generator | None],
        min_ps: Sequence[float] | None = None,
    ) -> SamplingMetadata:
        """Gather per-row Python values into tensors. ``top_k`` <= 0, ``top_p`` == 1 and ``min_p`` == 0
        mean off; a temperature below :data:`~modelrunner.sampling.SAMPLING_EPS` means greedy; a
        ``top_k`` beyond the vocabulary means all tokens."""
        min_ps = [0.0] * len(temperatures) if min_ps is None else min_ps
        if not len(temperatures) == len(top_ks) == len(top_ps) == len(generators) == len(min_ps):
            raise ValueError(
                f"per-row sampling lists must have equal lengths, got temperatures={len(temperatures)}, "
                f"top_ks={len(top_ks)}, top_ps={len(top_ps)}, generators={len(generators)}, min_ps={len(min_ps)}"
            )
        greedy = [t < SAMPLING_EPS for t in temperatures]
        all_greedy = all(greedy)
        sampled_rows = [i for i, g in enumerate(greedy) if not g]
        use_top_k = any(top_ks[i] > 0 for i in sampled_rows)
        use_top_p = any(top_ps[i] < 1.0 for i in sampled_rows)
        use_min_p = any(min_ps[i] > 0.0 for i in sampled_rows)
        return cls(
            temperature=torch.tensor([0.0 if g else t for g, t in zip(greedy, temperatures)], dtype=torch.float32),
            top_k=torch.tensor([min(max(k, 0), _TOP_K_CAP) for k in top_ks], dtype=torch.int64) if use_top_k else None,
            top_p=torch.tensor(top_ps, dtype=torch.float32) if use_top_p else None,
            min_p=torch.tensor(min_ps, dtype=torch.float32) if use_min_p else None,
            generators=tuple(generators),
            all_greedy=all_greedy,
            any_greedy=any(greedy),
        )


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k / top-p (nucleus) set. Returns a new tensor.

    :param top_k: [S] int64, 0 = off. :param top_p: [S] float32, 1 = off.
    """
    vocab = logits.shape[-1]
    if top_p is None:
        if top_k is None:
            return logits
        # top-k alone: a partial top-k is much cheaper than sorting the vocabulary.
        k_on = top_k > 0
        k_max = min(int(top_k.max()), vocab)
        values = logits.topk(k_max, dim=-1).values
        k = top_k.clamp(1, k_max).to(logits.device)
        threshold = values.gather(1, (k - 1).unsqueeze(1))
        threshold = threshold.masked_fill(~k_on.to(logits.device).unsqueeze(1), float("-inf"))
        return logits.masked_fill(logits < threshold, float("-inf"))

    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).to(logits.device)
        threshold = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < threshold, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1.0 - top_p.to(logits.device)).unsqueeze(1)
    drop[:, -1] = False  # the most likely token always stays
    sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _uniforms(rows: int, generators: tuple[torch.Generator | None, ...], shared: torch.Generator | None,
              device: torch.device) -> torch.Tensor:
    """One uniform in ``[0, 1)`` per row, float32 on ``device``: a seeded row's from its own generator
    (one number a step, whatever else shares the batch), the others' from ``shared`` in one call."""
    u = torch.empty(rows, dtype=torch.float32, device=device)
    unseeded = [row for row, gen in enumerate(generators) if gen is None]
    if unseeded:
        where = shared.device if shared is not None else device
        u[unseeded] = torch.rand(len(unseeded), generator=shared, device=where).to(device)
    for row, gen in enumerate(generators):
        if gen is not None:
            u[row] = torch.rand(1, generator=gen, device=gen.device).to(device)
    return u


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row ``i``'s token drawn from ``weights[i]`` (non-negative, any positive scale) with its uniform
    ``u[i]``: the first token whose running sum passes ``u[i]`` times the row's total. One number a row
    and one pass over the vocabulary (``weights`` is overwritten by the running sums); a token of zero
    weight is never drawn."""
    cdf = weights.cumsum_(dim=-1)
    total = cdf[:, -1:]
    # Below the total (a float32 product may round up to it), so the token found has a positive weight.
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def sample(
    logits: torch.Tensor, metadata: SamplingMetadata, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Pick one token per row of ``logits``.

    Greedy rows take the argmax. The others are scaled by their temperature, cut to their top-k /
    top-p set and by min-p, and drawn by inverse transform: one uniform a row against the running sum
    of its weights (as ``torch.multinomial`` draws; on a CPU a fifth of the cost of the exponential
    race, whose one exponential per vocabulary entry took most of a large batch's step). A seeded row's
    number comes from its own generator only, so its tokens do not depend on which other rows share
    the batch.

    :param logits: [S, V] logits of the rows to sample.
    :param metadata: per-row parameters (S rows).
    :param generator: the shared generator for rows without their own (None: torch's default).
    :returns: [S] int64 token ids.
    """
    if logits.dim() != 2 or logits.shape[0] != metadata.temperature.shape[0]:
        raise ValueError(
            f"logits must be [num_rows, vocab] with num_rows={metadata.temperature.shape[0]}, "
            f"got shape {tuple(logits.shape)}"
        )
    logits = logits.float()
    if metadata.all_greedy:
        return argmax_rows(logits)
    greedy_ids = argmax_rows(logits) if metadata.any_greedy else None
    weights, is_greedy = _filtered_weights(logits, metadata)
    sampled = _inverse_cdf(weights, _uniforms(len(weights), metadata.generators, generator, weights.device))
    if greedy_ids is None:
        return sampled
    return torch.where(is_greedy, greedy_ids, sampled)


def _filtered_weights(logits: torch.Tensor, metadata: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's probabilities times a positive number of its own — ``exp(scaled - max)``, 1 at the
    likeliest token — with temperature, top-k / top-p and min-p applied; and which rows are greedy."""
    temperature = metadata.temperature.to(logits.device)
    is_greedy = temperature == 0.0
    scaled = logits / torch.where(is_greedy, 1.0, temperature).unsqueeze(1)
    scaled = apply_top_k_top_p(scaled, metadata.top_k, metadata.top_p)
    weights = scaled.sub_(scaled.amax(dim=-1, keepdim=True)).exp_()
    if metadata.min_p is not None:  # less likely than min_p times the likeliest: dropped
        weights.masked_fill_(weights < metadata.min_p.to(weights.device).unsqueeze(1), 0.0)
    return weights, is_greedy


def _filtered_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``logits`` with temperature, top-k / top-p and min-p applied, as probabilities (not
    renormalized after min-p), and which rows are greedy."""
    temperature = metadata.temperature.to(logits.device)
    is_greedy = temperature == 0.0
    scaled = logits / torch.where(is_greedy, 1.0, temperature).unsqueeze(1)
    scaled = apply_top_k_top_p(scaled, metadata.top_k, metadata.top_p)
    probs = scaled.softmax(dim=-1)
    if metadata.min_p is not None:
        # Tokens less likely than min_p times the likeliest are dropped (the likeliest always stays).
        floor = probs.amax(dim=-1, keepdim=True) * metadata.min_p.to(probs.device).unsqueeze(1)
        probs = probs.masked_fill_(probs < floor, 0.0)
    return probs, is_greedy


def sampling_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution :func:`sample` draws each row from, normalized: temperature, top-k / top-p and
    min-p applied; a greedy row is one-hot at its argmax. (Speculative decoding accepts proposals
    against it.)

    :returns: [S, V] float32 probabilities.
    """
    logits = logits.float()
    probs, is_greedy = _filtered_probs(logits, metadata)
    if metadata.min_p is not None:
        probs = probs.div_(probs.sum(dim=-1, keepdim=True))
    if metadata.any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(1, argmax_rows(logits).view(-1, 1), 1.0)
        probs = torch.where(is_greedy.unsqueeze(1), one_hot, probs)
    return probs


class Sampler:
    """Callable form of :func:`sample` holding the shared generator (seeded from the runner config)."""

    def __init__(self, seed: int | None = None) -> None:
        self.generator: torch.Generator | None = None if seed is None else torch.Generator().manual_seed(seed)
        """Generator for rows whose request has no seed of its own."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Next token ids ``[S]`` for ``logits`` ``[S, V]``."""
        generator = self.generator
        if generator is not None and generator.device != logits.device:
            generator = None
        return sample(logits, metadata, generator)
