"""A model-free runner for engine tests: its "KV cache" stores token ids, so paging bugs show.

``FakeRunner.execute_model`` writes every new token id at its slot, then, for each sampled row,
reads the sequence's whole context back through its block table and returns logits that are a
deterministic function of that context. A wrong slot mapping, block table, copy-on-write or prefix
hit changes the context it reads, hence the tokens generated, so comparing against running each
prompt alone checks the whole paging path. Reading a slot nobody wrote fails at once.
"""

from __future__ import annotations

import types

import pytest
import torch

from modelrunner.config import RunnerConfig
from modelrunner.executor import Executor
from modelrunner.forward_batch import ForwardOutput
from modelrunner.plugins import get_plugins

VOCAB = 64
EOS = 0


class FakeTokenizer:
    """Token ``t`` reads ``"t,"``; EOS (0) is special and reads ``"</s>"``; text encodes char by char."""

    eos_token_id = EOS
    bos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % (VOCAB - 1) + 1 for c in text]

    def decode(self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False) -> str:
        return "".join("" if (t == EOS and skip_special_tokens) else ("</s>" if t == EOS else f"{t},") for t in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kw):
        return "".join(f"[{m['role']}]{m['content']}" for m in messages) + ("[assistant]" if add_generation_prompt else "")


def context_logits(tokens: list[int]) -> torch.Tensor:
    """Deterministic logits for the next token after ``tokens``."""
    h = 1469598103934665603
    for t in tokens:
        h = ((h ^ (t + 1)) * 1099511628211) % (1 << 61)
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(h)) * 3.0


class _FakeModel(types.SimpleNamespace):
    """What the engine reads of a loaded model."""

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset() if self.eos is None else frozenset({self.eos, *( [self.tokenizer.eos_token_id]
                                                                            if self.tokenizer.eos_token_id is not None
                                                                            else [])})


class FakeRunner(Executor):
    """Quacks like an executor for the engine: tokenizer, block count, execute_model, copy_blocks.

    The engine lends it the allocator it creates (``runner.allocator``), as it does to real executors.
    """

    def __init__(self, num_blocks: int = 64, block_size: int = 4, max_model_len: int = 128,
                 enable_prefix_caching: bool = True, eos_token_id: int | None = EOS, **scheduler) -> None:
        self._config = RunnerConfig.from_dict({"model": "fake", "block_size": block_size,
                                               "enable_prefix_caching": enable_prefix_caching, **scheduler})
        self._num_blocks = num_blocks
        self._max_model_len = max_model_len
        self._tokenizer = FakeTokenizer()
        self._loaded = _FakeModel(vocab_size=VOCAB, hf_config=types.SimpleNamespace(eos_token_id=eos_token_id),
                                  kv_cache_spec=object(), eos=eos_token_id, tokenizer=self._tokenizer,
                                  adapter="fake", extra={})
        self.kv = torch.full((num_blocks * block_size,), -1, dtype=torch.long)
        self.batches: list = []
        self.fail_on_token: int | None = None
        """A forward whose batch holds this token raises (every time)."""
        self.fail_next = 0
        """The next this many forwards raise, whatever they hold (a transient fault)."""
        self.nan_on_token: int | None = None
        """A sequence whose context holds this token gets NaN logits (a broken model)."""

    # The executor interface, answered without a model.
    config = property(lambda self: self._config)
    plugins = property(lambda self: get_plugins())
    loaded = property(lambda self: self._loaded)
    num_blocks = property(lambda self: self._num_blocks)
    block_size = property(lambda self: self._config.cache.block_size)
    max_model_len = property(lambda self: self._max_model_len)
    tokenizer = property(lambda self: self._tokenizer)
    kv_cache_spec = property(lambda self: self._loaded.kv_cache_spec)
    kv_cache_bytes = property(lambda self: int(self.kv.numel() * 8))
    allocator = property(lambda self: self.scratch.lent_allocator)

    def load_model(self):
        return self._loaded

    def shutdown(self) -> None:
        pass

    def stats(self) -> dict:
        return {}

    def process_inputs(self, prompt_text, token_ids, extra):
        return token_ids, extra

    def _require_loaded(self):
        return self._loaded

    def copy_blocks(self, copies) -> None:
        bs = self.block_size
        for src, dst in copies:
            self.kv[dst * bs:(dst + 1) * bs] = self.kv[src * bs:(src + 1) * bs]

    def execute_model(self, batch) -> ForwardOutput:
        if self.fail_on_token is not None and bool((batch.input_ids == self.fail_on_token).any()):
            raise RuntimeError(f"token {self.fail_on_token} is poison")
        if self.fail_next > 0:
            self.fail_next -= 1
            raise RuntimeError("transient fault")
        self.batches.append(batch)
        self.kv[batch.slot_mapping] = batch.input_ids
        qsl = batch.query_start_loc.tolist()
        ctx = batch.context_lens.tolist()
        bs = batch.block_size
        rows = []
        for j in batch.logits_indices.tolist():
            i = next(k for k in range(batch.num_seqs) if qsl[k] <= j < qsl[k + 1])
            last = ctx[i] + (j - qsl[i])
            table = batch.block_tables[i].tolist()
            slots = [table[p // bs] * bs + p % bs for p in range(last + 1)]
            tokens = self.kv[slots].tolist()
            assert -1 not in tokens, f"sequence {batch.seq_ids[i]} read an unwritten KV slot"
            row = context_logits(tokens)
            if self.nan_on_token is not None and self.nan_on_token in tokens:
                row = torch.full_like(row, float("nan"))
            rows.append(row)
        return ForwardOutput(logits=torch.stack(rows) if rows else torch.zeros(0, VOCAB))


@pytest.fixture
def fake_runner():
    """Factory: ``fake_runner(num_blocks=..., block_size=..., max_num_seqs=..., ...)``."""
    return FakeRunner


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request):
    """Tiny models gain nothing from a second thread, and two spinning threads starve when other
    processes share the 2 cores; the real-model (slow) tests keep torch's default."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
