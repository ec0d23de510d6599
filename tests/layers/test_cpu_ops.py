"""The fused CPU layer ops (RMSNorm with its residual add, rotary embeddings, the logits scans), in
float32 and bfloat16, against torch's versions of the same layers (the plain layers; the ops run through the forwards the
``cpu_fused`` compile backend binds onto them), and their refusals of bad input."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from modelrunner.layers import (
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    cpu_ops,
    sdpa_attention,
)
from modelrunner import native, native_build
from modelrunner_compile_cpu_fused import fused_ops

pytestmark = pytest.mark.skipif(cpu_ops.ops() is None, reason="the fused CPU ops were not built at install")


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("width", [576, 100])
def test_rms_norm_matches_torch(rows, width):
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(width, 1e-5)
    norm.weight.data = torch.randn(width, generator=gen)
    x, residual = torch.randn(rows, width, generator=gen) * 3, torch.randn(rows, width, generator=gen)
    torch.testing.assert_close(fused_ops.rms_norm(norm, x), norm(x), rtol=1e-5, atol=1e-5)
    out, summed = fused_ops.rms_norm(norm, x, residual)
    want_out, want_sum = norm(x, residual)
    assert torch.equal(summed, want_sum)  # the residual stream is exact
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    assert fused_ops.rms_norm(norm, torch.zeros(0, width)).shape == (0, width)


def test_rotary_matches_torch_on_a_strided_view():
    rope = RotaryEmbedding(64, 4096, {"rope_type": "default", "rope_theta": 100000.0})
    qkv = torch.randn(5, 15 * 64)
    qk = qkv[:, : 12 * 64].view(5, 12, 64)  # q and k heads of a fused projection: not contiguous
    positions = torch.tensor([0, 3, 100, 4095, 7])
    got = fused_ops.rotate(rope, positions, qk)
    assert got.is_contiguous() and got.shape == (5, 12, 64)
    torch.testing.assert_close(got, rope.rotate(positions, qk), rtol=1e-6, atol=1e-6)


def test_silu_and_mul_matches_torch():
    x = torch.randn(3, 2 * 96) * 4
    torch.testing.assert_close(fused_ops.silu_and_mul(SiluAndMul(), x), SiluAndMul()(x), rtol=0, atol=0)


def test_kv_write_matches_torch():
    kv_heads, head_dim = 3, 8
    kv = torch.zeros(2, 4, 2, kv_heads, head_dim)  # 4 blocks of 2 slots
    qkv = torch.randn(3, (2 + 2 * kv_heads) * head_dim)
    key = qkv[:, 2 * head_dim:(2 + kv_heads) * head_dim].view(3, kv_heads, head_dim)  # strided views, as in the layer
    value = qkv[:, (2 + kv_heads) * head_dim:].view(3, kv_heads, head_dim)
    slots = torch.tensor([5, 0, 7])
    want = kv.clone()
    sdpa_attention._store_kv(want, slots, key, value)
    fused_ops.write_kv(sdpa_attention.TorchSDPABackend(), kv, slots, key, value)
    assert torch.equal(kv, want) and torch.equal(kv[0].view(-1, kv_heads, head_dim)[5], key[0])


@pytest.mark.parametrize("vocab", [1, 15, 49152, 49157])
def test_argmax_rows_is_torchs_argmax(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen)
    logits[1] = float("-inf")                   # all -inf: index 0, like torch
    logits[2, vocab // 2:] = logits[2].max() + 1  # ties: the first maximum
    logits[3, -1] = float("inf")
    logits[4, vocab // 3] = float("nan")        # torch ranks NaN highest
    logits[5, 0], logits[5, -1] = float("inf"), float("nan")
    assert torch.equal(cpu_ops.argmax_rows(logits), logits.argmax(-1))
    assert cpu_ops.argmax_rows(torch.zeros(0, vocab)).shape == (0,)


def test_broken_rows_finds_nan_inf_and_all_masked_rows():
    logits = torch.randn(6, 1000)
    logits[1, 7] = float("nan")
    logits[2, 999] = float("inf")
    logits[3] = float("-inf")
    logits[4, :999] = float("-inf")  # one token left: fine
    logits[5, 500] = float("-inf")
    assert cpu_ops.broken_rows(logits).tolist() == [False, True, True, True, False, False]
    want = torch.isnan(logits).any(1) | torch.isposinf(logits).any(1) | torch.isneginf(logits).all(1)
    assert torch.equal(cpu_ops.broken_rows(logits), want)
    strided = logits.t()  # not contiguous: torch's version, the same answer
    assert torch.equal(cpu_ops.broken_rows(strided.t()), want)


def test_bad_input_is_refused_by_name():
    ops = cpu_ops.ops()
    table = torch.randn(16, 8)
    with pytest.raises(ValueError, match=r"position 16 of token 1 is outside the table's \[0, 16\)"):
        ops.rotary(torch.tensor([0, 16]), torch.randn(2, 1, 8), table)
    with pytest.raises(ValueError, match=r"weight must be Float \[8\]"):
        ops.rms_norm(torch.randn(2, 8), torch.randn(9), 1e-6)
    with pytest.raises(ValueError, match=r"slot 8 of token 0 is outside the cache's \[0, 8\)"):
        ops.store_kv(torch.zeros(2, 4, 2, 1, 8), torch.tensor([8]), torch.randn(1, 1, 8), torch.randn(1, 1, 8))
    with pytest.raises(ValueError, match="residual must have x's shape"):
        ops.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match=r"logits must be a contiguous float32 CPU tensor \[rows, vocab\], got Double"):
        ops.argmax_rows(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="argmax of an empty row"):
        ops.argmax_rows(torch.zeros(2, 0))


def one_rounding_apart(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bfloat16 values equal but for the odd one a float32 sum of squares in another order rounds the
    other way: one bfloat16 step apart, at a few in a thousand."""
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)
    assert (got != want).float().mean() < 0.005


def test_in_bfloat16_the_norms_rotary_product_and_kv_write_are_torchs():
    # A bfloat16 engine's layers: the ops round where torch's bfloat16 versions round (rotary, the gated
    # product and the KV write bit for bit; the norms up to the order of their sum of squares).
    bf = torch.bfloat16
    gen = torch.Generator().manual_seed(5)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = (torch.rand(576, generator=gen) + 0.5).to(bf)
    for rows in (1, 7, 300):
        x, residual = (torch.randn(rows, 576, generator=gen) * 3).to(bf), torch.randn(rows, 576, generator=gen).to(bf)
        one_rounding_apart(fused_ops.rms_norm(norm, x), norm(x))
        out, summed = fused_ops.rms_norm(norm, x, residual)
        want_out, want_sum = norm(x, residual)
        assert torch.equal(summed, want_sum)  # the residual stream is exact
        one_rounding_apart(out, want_out)
    rope = RotaryEmbedding(64, 4096, {"rope_type": "default", "rope_theta": 100000.0})
    rope.cos_sin_cache = rope.cos_sin_cache.to(bf)
    qk = torch.randn(5, 15 * 64, generator=gen).to(bf)[:, : 12 * 64].view(5, 12, 64)
    positions = torch.tensor([0, 3, 100, 4095, 7])
    assert torch.equal(fused_ops.rotate(rope, positions, qk), rope.rotate(positions, qk))
    x = (torch.randn(3, 2 * 96, generator=gen) * 4).to(bf)
    assert torch.equal(fused_ops.silu_and_mul(SiluAndMul(), x), SiluAndMul()(x))
    kv, key, value = torch.zeros(2, 4, 2, 3, 8, dtype=bf), torch.randn(3, 3, 8).to(bf), torch.randn(3, 3, 8).to(bf)
    want = kv.clone()
    sdpa_attention._store_kv(want, torch.tensor([5, 0, 7]), key, value)
    fused_ops.write_kv(sdpa_attention.TorchSDPABackend(), kv, torch.tensor([5, 0, 7]), key, value)
    assert torch.equal(kv, want)
    with pytest.raises(ValueError, match=r"weight must be BFloat16 \[8\], got Float"):
        cpu_ops.ops().rms_norm(torch.randn(2, 8).to(bf), torch.randn(8), 1e-6)


def test_other_dtypes_and_autograd_keep_torchs_ops():
    assert cpu_ops.fused(torch.randn(2, 8, dtype=torch.bfloat16)) is None  # the sampler's scans: float32 only
    assert cpu_ops.fused(torch.randn(2, 8, dtype=torch.float16), bf16=True) is None
    assert cpu_ops.fused(torch.randn(2, 8, requires_grad=True)) is None
    norm = RMSNorm(8)
    x = torch.randn(2, 8, requires_grad=True)
    norm(x).sum().backward()  # torch's version: differentiable
    assert x.grad is not None


_CHECK_BUILD = textwrap.dedent("""
    import torch
    from modelrunner.layers import cpu_ops
    ops = cpu_ops.ops()
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 49157, generator=gen)
    logits[1, 40000] = float("nan"); logits[2] = float("-inf"); logits[3, 9] = float("inf")
    logits[4, 3:] = logits[4].max() + 1
    assert torch.equal(ops.argmax_rows(logits), logits.argmax(-1))
    assert ops.broken_rows(logits).tolist() == [False, True, True, True, False]
    x, w = torch.randn(3, 100, generator=gen), torch.randn(100, generator=gen)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), torch.nn.functional.rms_norm(x, (100,), w, 1e-5))
    xb, wb = x.bfloat16(), w.bfloat16()
    want = wb * torch.nn.functional.rms_norm(xb.float(), (100,), None, 1e-5).bfloat16()
    torch.testing.assert_close(ops.rms_norm(xb, wb, 1e-5).float(), want.float(), rtol=2**-7, atol=1e-6)
    print("OK")
""")


@pytest.mark.parametrize("variant", cpu_ops.VARIANTS)
def test_every_installed_build_this_cpu_runs_agrees(variant):
    # The AVX-512 build where the CPU has it, the AVX2 code Zen 1-3 run, the portable code for the rest.
    if not native.runnable(next(v for v in native_build.VARIANTS if v.name == variant)):
        pytest.skip(f"this CPU cannot run the {variant} build")
    env = {**os.environ, native.VARIANT_ENV: variant}
    result = subprocess.run([sys.executable, "-c", _CHECK_BUILD], check=False, capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


def test_turned_off_by_the_environment():
    script = textwrap.dedent("""
        from modelrunner.layers import cpu_ops
        print("ops", cpu_ops.ops())
    """)
    env = {**os.environ, cpu_ops.DISABLE_ENV: "0"}
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, env=env,
                            timeout=120)
    assert "ops None" in result.stdout, result.stderr[-2000:]
