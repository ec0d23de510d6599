"""A proposer that proposes garbage: random ids (some outside the vocabulary), too many of them, and
now and then something that is not a list of ids at all. Speculative decoding must stay exact with it:
only slower."""

from __future__ import annotations

import random

from modelrunner import hookimpl
from modelrunner.spec_decode import Proposer


class GarbageProposer(Proposer):
    """Random proposals from a fixed seed (so runs repeat)."""

    name = "garbage"

    def __init__(self, context) -> None:
        super().__init__(context)
        self.rng = random.Random(0)

    def propose(self, requests):
        vocab = self.context.vocab_size
        out = []
        for request in requests:
            roll = self.rng.random()
            if roll < 0.05:
                out.append("not tokens")
            elif roll < 0.1:
                out.append([None, 3])
            else:
                count = self.rng.randint(0, request.num_tokens + 3)
                out.append([self.rng.randint(-2, vocab + 2) if self.rng.random() < 0.1 else self.rng.randrange(vocab)
                            for _ in range(count)])
        return out


@hookimpl
def register(registry):
    registry.proposers(GarbageProposer)
