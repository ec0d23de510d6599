"""The ``cpu_paged`` attention plugin: its C++ kernel against a float64 reference (dtypes, head sizes,
GQA, sliding windows, long contexts split into merged chunks), its errors, and the engine on it."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modelrunner import LLM, SamplingParams
from modelrunner.errors import UnknownNameError
from modelrunner.plugins import get_plugins

kernel = pytest.importorskip("modelrunner_attention_cpu")
if "cpu_paged" not in get_plugins().attention_backends("cpu"):
    pytest.skip("the cpu_paged kernel does not build here", allow_module_level=True)


def _paged(seq_lens, heads, kv_heads, head_dim, block_size=16, dtype=torch.float32, table_dtype=torch.long, seed=0):
    """Random keys/values per sequence, stored in shuffled blocks of a cache with spare blocks."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 5
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in per_seq:
        tables.append(order[:n] + [0] * (max(per_seq) - n))  # padding entries are never read
        order = order[n:]
    query = torch.randn(len(seq_lens), heads, head_dim, generator=gen).to(dtype)
    return query, cache, torch.tensor(tables, dtype=table_dtype), torch.tensor(seq_lens)


def _reference(query, cache, table, seq_lens, scale, window):
    out = torch.empty(query.shape, dtype=torch.float64)
    heads, kv_heads = query.shape[1], cache.shape[3]
    for s, n in enumerate(seq_lens.tolist()):
        rows = cache[:, table[s].long()].flatten(1, 2)[:, :n].double()  # [2, n, kv_heads, d]
        first = max(0, n - window) if window else 0
        k = rows[0, first:].repeat_interleave(heads // kv_heads, 1)
        v = rows[1, first:].repeat_interleave(heads // kv_heads, 1)
        weights = (torch.einsum("hd,khd->hk", query[s].double(), k) * scale).softmax(-1)
        out[s] = torch.einsum("hk,khd->hd", weights, v)
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("seq_lens,heads,kv_heads,head_dim,window", [
    ([129, 1, 40, 17, 64, 300, 5, 16, 33, 90], 9, 3, 64, None),  # SmolLM2's heads; whole sequences per thread
    ([129, 1, 40, 17, 64, 300, 5, 16, 33, 90], 9, 3, 64, 37),    # sliding window, shorter and longer sequences
    ([77], 4, 4, 20, None),                                       # one sequence split by head; a head_dim tail
    ([3, 250], 8, 2, 128, 100),
    ([1000, 3], 8, 2, 64, None),                                  # long context cut into chunks, merged; empty chunks
    ([1500], 6, 3, 128, 700),                                     # chunks of a sliding window
])
def test_kernel_matches_reference(dtype, tol, seq_lens, heads, kv_heads, head_dim, window):
    query, cache, table, lens = _paged(seq_lens, heads, kv_heads, head_dim, dtype=dtype)
    scale = head_dim ** -0.5
    out = kernel.paged_decode_attention(query, cache, table, lens, scale, window)
    assert out.dtype == dtype and out.shape == query.shape
    torch.testing.assert_close(out.double(), _reference(query, cache, table, lens, scale, window), atol=tol, rtol=tol)


def test_kernel_takes_int32_tables_and_strided_queries():
    query, cache, table, lens = _paged([50, 20, 7], 6, 2, 32)
    expected = kernel.paged_decode_attention(query, cache, table, lens, 0.2)
    strided = torch.cat([query, query], dim=2)[:, :, :32]
    torch.testing.assert_close(kernel.paged_decode_attention(strided, cache, table.int(), lens.int(), 0.2), expected)


@pytest.mark.parametrize("change,message", [
    (lambda q, c, t, n: (q, c, t.index_fill(1, torch.tensor([1]), 99), n),
     r"block_table\[0, 1\] = 99 is not a block of the cache \(0\.\.\d+\)"),
    (lambda q, c, t, n: (q, c, t, n + 1000), r"a seq_len of 1050 needs more than the 4 blocks of 16 slots"),
    (lambda q, c, t, n: (q, c, t, n * 0), r"at least one cached position, got seq_len 0"),
    (lambda q, c, t, n: (q.double(), c, t, n), r"query dtype Double differs from kv_cache dtype Float"),
    (lambda q, c, t, n: (q[:, :5], c, t, n), r"num_heads \(5\) must be a multiple of num_kv_heads \(2\)"),
    (lambda q, c, t, n: (q, c.transpose(1, 2), t, n), r"kv_cache must be contiguous"),
    (lambda q, c, t, n: (q, c, t.float(), n), r"block_table must be int32 or int64, got Float"),
    (lambda q, c, t, n: (q, c, t[:1], n), r"block_table must be \[num_seqs, max_blocks\] with num_seqs = 2"),
])
def test_kernel_rejects_bad_input_by_name(change, message):
    query, cache, table, lens = _paged([50, 20], 6, 2, 32)
    with pytest.raises(RuntimeError, match=message):
        kernel.paged_decode_attention(*change(query, cache, table, lens), 0.2)


def test_listed_as_a_plugin_with_its_backend():
    listing = subprocess.run([sys.executable, "-m", "modelrunner.cli", "plugins", "--json"], capture_output=True,
                             text=True, timeout=120, check=True)
    plugin = {p["name"]: p for p in json.loads(listing.stdout)}["attention-cpu"]
    assert plugin["distribution"] == "modelrunner-attention-cpu"
    assert plugin["provides"] == {"attention_backends": ["cpu_paged"]} and plugin["error"] is None


@pytest.mark.slow
def test_smollm2_generates_the_same_text_on_either_backend():
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at", "List three colors:"]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    texts = {}
    for backend in ("torch_sdpa", "cpu_paged"):
        llm = LLM("smollm2", attention_backend=backend, max_num_batched_tokens=64)
        layer = llm.runner.loaded.model.model.layers[0].self_attn.attn
        assert layer.backend.name == backend
        # A small token budget chunks the prompts, so decodes run beside prompt chunks too.
        texts[backend] = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    assert texts["cpu_paged"] == texts["torch_sdpa"]
    assert "Paris" in texts["cpu_paged"][0]


def test_unknown_attention_backend_is_named_with_the_installed_ones():
    with pytest.raises(UnknownNameError, match=r"unknown attention backend 'cpu_pagd'; installed: cpu_paged, "
                                               r"torch_sdpa\. Did you mean 'cpu_paged'\?"):
        LLM("smollm2", attention_backend="cpu_pagd")


def test_without_its_installed_build_it_steps_aside_for_torch_sdpa(tmp_path):
    # The package as pip leaves it where the build failed (no compiler): the sources, no libraries.
    package = Path(importlib.util.find_spec("modelrunner_attention_cpu").origin).parent
    shutil.copytree(package, tmp_path / package.name, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    script = """
import warnings
from modelrunner.plugins import get_plugins
plugins = get_plugins()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    usable = plugins.attention_backends("cpu")
print("USABLE", usable)
print("DEFAULT", plugins.attention_backend("cpu").name)
print("WARNED", [str(w.message) for w in caught])
try:
    plugins.attention_backend("cpu", "cpu_paged")
except ValueError as e:
    print("ASKED", e)
"""
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "USABLE ['torch_sdpa']" in out and "DEFAULT torch_sdpa" in out
    assert "attention backend 'cpu_paged' is unavailable, torch_sdpa is used instead: the paged-attention kernel is not built" in out
    assert "ASKED attention backend 'cpu_paged' does not support device cpu" in out
