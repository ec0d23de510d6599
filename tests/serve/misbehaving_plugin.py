"""Test-only plugins that misbehave, laid out as the ``serve-test-misbehaving`` distribution for a
server's ``PYTHONPATH`` (see ``tests/serve/conftest.py``):

- grammar backend ``slow``: a ``grammar`` constraint holding ``compile_s=X``, ``mask_s=Y`` and
  ``size_mb=Z`` takes X seconds to compile into Z MiB of memory (reported by ``compiled_size``) and Y
  seconds per token mask; it allows every token and never completes (so a request ends at
  ``max_tokens``). Its ``auto_order`` is None: only requests that name it use it.
- proposer ``misbehaving``: proposes nothing, except for a sequence whose tokens hold one of the
  markers: ``BLOCK`` (its call sleeps ``$MISBEHAVING_BLOCK_S`` seconds, default 5), ``ENDLESS`` (its
  proposal is an endless iterator, which raises MemoryError once a million tokens were read from it,
  as a real one would end) or ``MUTATE`` (it appends to the token ids it was given).
"""

from __future__ import annotations

import itertools
import os
import re
import time

from modelrunner import hookimpl
from modelrunner.spec_decode import Proposer
from modelrunner.structured_output import GrammarBackend, GrammarMatcher

BLOCK, ENDLESS, MUTATE = 49101, 49102, 49103


class SlowMatcher(GrammarMatcher):
    """Every token allowed, each mask after ``mask_s`` seconds."""

    def __init__(self, mask_s: float) -> None:
        self.mask_s = mask_s

    def fill_bitmask(self, bitmask, row):
        time.sleep(self.mask_s)
        bitmask[row] = -1

    def accept_tokens(self, tokens):
        return True

    def rollback(self, num_tokens):
        return None

    def is_terminated(self):
        return False


class SlowBackend(GrammarBackend):
    """Compiles and masks as slowly as its grammar says."""

    name = "slow"
    constraints = ("grammar",)

    def compile(self, spec):
        found = dict(re.findall(r"(compile_s|mask_s|size_mb)=([0-9.]+)", spec.value))
        time.sleep(float(found.get("compile_s", 0)))
        memory = bytearray(b"\1") * (int(found.get("size_mb", 0)) << 20)  # written: resident
        return float(found.get("mask_s", 0)), memory

    def compiled_size(self, compiled):
        return len(compiled[1])

    def matcher(self, compiled):
        return SlowMatcher(compiled[0])


def _endless():
    for count in itertools.count():
        if count >= 1_000_000:
            raise MemoryError("read a million proposed tokens")
        yield 5


class MisbehavingProposer(Proposer):
    """See the module docstring."""

    name = "misbehaving"

    def propose(self, requests):
        out = []
        for request in requests:
            tokens = request.token_ids
            if BLOCK in tokens:
                time.sleep(float(os.environ.get("MISBEHAVING_BLOCK_S", "5")))
                out.append([])
            elif ENDLESS in tokens:
                out.append(_endless())
            elif MUTATE in tokens:
                tokens.append(7)
                out.append([])
            else:
                out.append([])
        return out


@hookimpl
def register(registry):
    registry.grammar_backends(SlowBackend)
    registry.proposers(MisbehavingProposer)
