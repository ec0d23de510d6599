"""Deliberately broken plugins, each a real installed distribution, caught by the suite of its kind:
the checks its defect breaks fail with a message naming the defect, the others pass."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
from modelrunner_kit.conformance import suite
from modelrunner.plugins import Plugins
from plugin_dists import make_distribution

OFF_BY_ONE_WINDOW = """
from modelrunner import hookimpl
from modelrunner.layers.sdpa_attention import TorchSDPABackend


class OffByOneWindow(TorchSDPABackend):
    '''torch_sdpa whose sliding window lets one position too many through.'''

    name = "off_by_one_window"
    priority = -100

    def _metadata(self, batch, sliding_windows):
        meta = super()._metadata(batch, tuple(None if w is None else w + 1 for w in sliding_windows))
        meta.masks = {None if w is None else w - 1: mask for w, mask in meta.masks.items()}
        return meta


@hookimpl
def register(registry):
    registry.attention_backends(OffByOneWindow)
"""

LEAKY_ALLOCATOR = """
from modelrunner import hookimpl
from modelrunner.kv_cache.paged import PagedBlockAllocator


class Leaky(PagedBlockAllocator):
    '''The paged allocator, except that free() never gives back a sequence's first block.'''

    name = "leaky"

    def free(self, seq_id):
        seq = self._seq(seq_id)
        for block in reversed(seq.block_table[1:]):
            self._release(block)
        del self._seqs[seq_id]


@hookimpl
def register(registry):
    registry.allocators("leaky", prefix_caching=True)


@hookimpl
def allocate(num_blocks, block_size, max_model_len, config):
    return Leaky(num_blocks, block_size, max_model_len, enable_prefix_caching=config.enable_prefix_caching)
"""

BATCH_NORMALISED = """
from modelrunner import hookimpl
from modelrunner.sampling import LogitsProcessor


class BatchCentred(LogitsProcessor):
    '''Divides logits by a temperature after centring them on the mean of the whole batch.'''

    name = "batch_centred"
    example_args = ({"temperature": 2.0}, {"temperature": 0.5})
    invalid_args = ({"temperature": 0},)

    def request_state(self, params, args):
        temperature = args.get("temperature", 1.0)
        if not temperature > 0:
            raise ValueError(f"batch_centred: temperature must be > 0, got {temperature!r}")
        return float(temperature)

    def apply(self, logits, rows):
        scale = logits.new_tensor([row.state for row in rows]).unsqueeze(1)
        return (logits - logits.mean()) / scale


@hookimpl
def register(registry):
    registry.logits_processors(BatchCentred)
"""

RECOMPILING = """
import torch

from modelrunner import hookimpl
from modelrunner.defaults.eager import eager_model


@torch.compile(backend="eager")
def _next_positions(positions):
    return positions + 1


@hookimpl
def register(registry):
    registry.compile_backends("recompiling", devices=("cpu",))


@hookimpl
def compile(loaded, config):
    '''The eager model, plus a compiled helper whose graphs are thrown away every step.'''
    run = eager_model(loaded)

    def step(batch, kv_caches, **kwargs):
        torch._dynamo.reset()
        _next_positions(batch.positions)
        return run(batch, kv_caches, **kwargs)

    return step
"""

WRONG_DECODE = """
from modelrunner import hookimpl
from modelrunner.defaults.eager import eager_model


@hookimpl
def register(registry):
    registry.compile_backends("wrong_decode", devices=("cpu",))


@hookimpl
def compile(loaded, config):
    '''The eager model, with decode steps' hidden states 1% too large.'''
    run = eager_model(loaded)

    def step(batch, kv_caches, **kwargs):
        out = run(batch, kv_caches, **kwargs)
        return out * 1.01 if batch.is_decode_only else out

    return step
"""


@pytest.fixture
def install(tmp_path: Path):
    """``install(entry, module, source, *also)``: the kernel's plugins, the entry points ``also`` and
    a distribution laid out under ``tmp_path`` and put on ``sys.path`` (removed again, with its
    module, afterwards)."""
    added: list[tuple[str, str]] = []

    def installed(entry: str, module: str, source: str, *also: str) -> Plugins:
        root = make_distribution(tmp_path / entry, f"modelrunner-test-{entry}", entry, module, source)
        sys.path.insert(0, str(root))
        added.append((str(root), module))
        importlib.invalidate_caches()
        plugins = Plugins(allow=[entry, *also])
        assert entry in plugins.infos and not plugins.broken, plugins.broken
        return plugins

    yield installed
    for root, module in added:
        sys.path.remove(root)
        sys.modules.pop(module, None)
    importlib.invalidate_caches()


def _by_status(results) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {"passed": {}, "failed": {}, "skipped": {}}
    for r in results:
        out[r.status][r.check] = r.message
    return out


def test_attention_sliding_window_off_by_one(install):
    plugins = install("off_by_one", "mr_test_off_by_one", OFF_BY_ONE_WINDOW)
    results = _by_status(suite("attention_backends", "off_by_one_window", plugins=plugins).run())
    assert results["failed"] and all(check.endswith("/window=3") for check in results["failed"])
    assert results["passed"] and all(check.endswith("/window=none") for check in results["passed"])
    # Only where the window cuts off history (not a lone short prompt) can the extra position show.
    assert {"eager/decode-only/gqa4x2/window=3", "compiled/decode-only/gqa6x2/window=3"} <= set(results["failed"])
    message = results["failed"]["eager/decode-only/gqa4x2/window=3"]
    assert message.startswith("output vs reference (decode-only, 4 heads over 2 kv heads, window 3)")
    assert "Greatest absolute difference" in message


def test_allocator_leaking_blocks_on_free(install):
    plugins = install("leaky", "mr_test_leaky", LEAKY_ALLOCATOR)
    results = _by_status(suite("allocators", "leaky", plugins=plugins, shrink=False).run())
    failed = results["failed"]
    assert {"free-returns-every-block", "state-machine"} <= set(failed)
    assert "declared-capabilities" in results["passed"] and "allocate-gives-distinct-slots" in results["passed"]
    # The message shows the failing rule and the leaked blocks (one per sequence, the fork sharing its parent's).
    assert failed["free-returns-every-block"].startswith(
        "`assert (s.used_blocks, s.used_slots, s.reserved_slots) == (0, 0, 0)` failed (test_free_returns_every_block")
    assert "used_blocks=4" in failed["free-returns-every-block"]


def test_logits_processor_depending_on_the_batch(install):
    plugins = install("batch_centred", "mr_test_batch_centred", BATCH_NORMALISED)
    results = _by_status(suite("logits_processors", "batch_centred", plugins=plugins).run())
    assert set(results["failed"]) == {"batch-independence"}
    assert "batched with 5 other rows vs alone" in results["failed"]["batch-independence"]
    # Declared through the class attributes: examples and a refused argument.
    assert {"output-shape-dtype-finite", "determinism", "rejects-bad-arguments", "end-to-end"} <= set(
        results["passed"])


DOES_NOTHING = """
from modelrunner import hookimpl
from modelrunner.sampling import LogitsProcessor


class DoesNothing(LogitsProcessor):
    '''Claims to ban tokens; returns the logits unchanged.'''

    name = "does_nothing"
    example_args = ({"token_ids": [5]},)

    def apply(self, logits, rows):
        return logits


@hookimpl
def register(registry):
    registry.logits_processors(DoesNothing)
"""


def test_logits_processor_that_does_nothing(install):
    plugins = install("does_nothing", "mr_test_does_nothing", DOES_NOTHING)
    results = _by_status(suite("logits_processors", "does_nothing", plugins=plugins).run())
    assert set(results["failed"]) == {"changes-logits"}
    assert "left all 6 rows of the example requests unchanged" in results["failed"]["changes-logits"]


def test_compile_backend_recompiling_every_step(install):
    plugins = install("recompiling", "mr_test_recompiling", RECOMPILING, "llama")
    results = _by_status(suite("compile_backends", "recompiling", plugins=plugins).run())
    assert set(results["failed"]) == {"no-recompile-after-warm-up"}
    message = results["failed"]["no-recompile-after-warm-up"]
    assert message.startswith("the second round of the same step shapes compiled again:")
    assert "more dynamo frames" in message


def test_compile_backend_with_wrong_decode_output(install):
    plugins = install("wrong_decode", "mr_test_wrong_decode", WRONG_DECODE, "llama")
    results = _by_status(suite("compile_backends", "wrong_decode", plugins=plugins).run())
    assert "logits/decode-only" in results["failed"]
    assert {"logits/prefill", "logits/mixed-prefill-decode", "no-recompile-after-warm-up"} <= set(results["passed"])
    message = results["failed"]["logits/decode-only"]
    assert message.startswith("step 1 (decode, 2 sequences): logits differ from eager by")


LEAKY_TOOL_PARSER = """
from modelrunner import hookimpl
from modelrunner_serve.tool_parsers import HermesToolParser


class LeakyHermes(HermesToolParser):
    '''hermes, except that streaming sends everything, the start of the calls included.'''

    name = "leaky_hermes"

    def streamable(self, text):
        return len(text)


@hookimpl
def register(registry):
    registry.tool_parsers(LeakyHermes)
"""


def test_tool_parser_streaming_its_calls_as_content(install):
    plugins = install("leaky_hermes", "mr_test_leaky_hermes", LEAKY_TOOL_PARSER)
    results = _by_status(suite("tool_parsers", "leaky_hermes", plugins=plugins).run())
    assert set(results["failed"]) == {"streaming"}
    assert "sent a call's start as content" in results["failed"]["streaming"] or "which is not content" in \
        results["failed"]["streaming"]
    assert {"one-call", "several-calls", "plain-text", "unreadable-calls"} <= set(results["passed"])


OFF_BY_ONE_NGRAM = """
from modelrunner import hookimpl
from modelrunner.api import Proposer
from modelrunner_speculative import ngram_proposal


class OffByOneNgram(Proposer):
    '''Prompt lookup that proposes from one token too far on: the token after the one that followed.'''

    name = "off_by_one_ngram"

    def propose(self, requests):
        return [ngram_proposal(r.token_ids, 1, 3, r.num_tokens + 1)[1:] for r in requests]


@hookimpl
def register(registry):
    registry.proposers(OffByOneNgram)
"""

PADDED_WITH_MINUS_ONE = """
from modelrunner import hookimpl
from modelrunner.api import Proposer
from modelrunner_speculative import ngram_proposal


class Padded(Proposer):
    '''Prompt lookup whose proposals are padded to num_tokens with -1, as rows of a batched tensor are.'''

    name = "padded"

    def propose(self, requests):
        return [(ngram_proposal(r.token_ids, 1, 3, r.num_tokens) + [-1] * r.num_tokens)[:r.num_tokens]
                for r in requests]


@hookimpl
def register(registry):
    registry.proposers(Padded)
"""


def test_check_fails_a_proposer_whose_drafts_are_off_by_one(tmp_path):
    # Every check but acceptance passes it: its ids are valid and verification keeps the outputs exact.
    import json

    from plugin_dists import run_cli

    root = make_distribution(tmp_path, "modelrunner-test-off-by-one-ngram", "off_by_one_ngram", "mr_test_obo_ngram",
                             OFF_BY_ONE_NGRAM)
    result = run_cli("check", "off_by_one_ngram", "--json", pythonpath=root)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
    results: dict[str, dict[str, str]] = {"passed": {}, "failed": {}, "skipped": {}}
    for r in json.loads(result.stdout)["results"]:
        results[r["status"]][r["check"]] = r["message"]
    assert set(results["failed"]) == {"acceptance-on-copied-text"}
    message = results["failed"]["acceptance-on-copied-text"]
    assert re.match(r"on a prompt that repeats a 12-token passage, whose greedy continuation repeats it again, "
                    r"0 of \d+ drafted tokens were accepted \(0%\); a proposer that guesses the continuation of "
                    r"copied text gets close to 100% there \(the kernel's ngram does\), and at least 30% is expected; "
                    r"replayed over the output, its first guess matches the token one position later than the next "
                    r"one \d+ times and the next one 0 times: are its drafts off by one\?$", message), message
    assert {"valid-proposals", "forget-and-reuse-ids", "engine-outputs-unchanged"} <= set(results["passed"])


def test_out_of_vocabulary_drafts_are_counted_and_fail_the_proposer(install):
    plugins = install("padded", "mr_test_padded", PADDED_WITH_MINUS_ONE, "llama")
    results = _by_status(suite("proposers", "padded", plugins=plugins).run())
    # Every check that validates the ids; the drafts before the padding are still accepted.
    assert set(results["failed"]) == {"valid-proposals", "forget-and-reuse-ids", "engine-outputs-unchanged"}
    assert "acceptance-on-copied-text" in results["passed"]
    assert "proposed [-1, -1, -1] for sequence 2: not token ids below 256" in results["failed"]["valid-proposals"]
    assert re.fullmatch(r"\d+ proposal\(s\) had token ids outside the target's vocabulary \(0 … 255\); the engine "
                        r"cut them there", results["failed"]["engine-outputs-unchanged"])
