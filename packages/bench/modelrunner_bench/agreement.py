"""Whether two configurations generated the same tokens for the same prompts."""

from __future__ import annotations

from typing import Any


def token_agreement(baseline: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    """How far ``other``'s generated tokens match ``baseline``'s, position by position, prompt by prompt.

    :returns: ``token_agreement`` (equal tokens ÷ the larger of the two token counts, so a missing
        or extra token counts as different), ``identical_prompts``, ``num_prompts`` and ``first_divergence`` (per
        prompt, the first differing position, None where identical).
    """
    total = max(sum(map(len, baseline)), sum(map(len, other)))
    equal = 0
    divergence = []
    for b, o in zip(baseline, other):
        same = [x == y for x, y in zip(b, o)]
        equal += sum(same)
        first = next((i for i, s in enumerate(same) if not s), None)
        divergence.append(min(len(b), len(o)) if first is None and len(b) != len(o) else first)
    identical = sum(b == o for b, o in zip(baseline, other)) if len(baseline) == len(other) else 0
    return {"token_agreement": equal / total if total else 1.0, "identical_prompts": identical,
            "num_prompts": len(baseline), "first_divergence": divergence}
