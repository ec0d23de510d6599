"""The ``cpu_fused`` backend against the plain ``eager`` model: eager leaves every module as built,
cpu_fused rebinds and records, and both compute the same; how the default backend is chosen."""

from __future__ import annotations

import pytest
import torch
from modelrunner import LLM, SamplingParams
from modelrunner.config import CompileConfig
from modelrunner_compile_cpu_fused.unhooked import PLAIN_CLASS, skip_call_machinery

KW = dict(dtype="float32", device="cpu", kv_cache_memory=2**20, block_size=4, enable_prefix_caching=False)
IDS = [5, 9, 14, 2, 7, 11, 3]
PROMPTS = [{"prompt_token_ids": [5, 9, 17]}, {"prompt_token_ids": [3, 44, 21, 8, 90, 11, 2]}]


def _rebound(model: torch.nn.Module) -> list[str]:
    """What a compile backend changed on ``model``'s instances: bound methods, graphs, swapped classes."""
    found = [f"{name}.{attr}" for name, module in model.named_modules()
             for attr in ("forward", "rotate", "run_layers", "decode_graphs") if attr in vars(module)]
    found += [f"{name} class" for name, module in model.named_modules() if hasattr(type(module), PLAIN_CLASS)]
    found += [f"{name}.backend.write_kv" for name, module in model.named_modules()
              if "write_kv" in getattr(getattr(module, "backend", None), "__dict__", {})]
    return found


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_eager_is_the_plain_model_and_cpu_fused_computes_the_same(tiny_llama_dir):
    eager = LLM(str(tiny_llama_dir), compile=False, **KW)
    fused = LLM(str(tiny_llama_dir), **KW)  # the default on CPU
    assert eager.runner.stats()["compile"] == {"backend": "eager"}
    stats = fused.runner.stats()["compile"]
    assert stats["backend"] == "cpu_fused" and stats["unhooked_modules"] > 0 and "decode_graphs" in stats
    plain, rewritten = eager.runner.runner.loaded.model, fused.runner.runner.loaded.model
    assert _rebound(plain) == []
    assert _rebound(rewritten)
    torch.testing.assert_close(fused.runner.forward(IDS), eager.runner.forward(IDS), rtol=1e-4, atol=1e-4)
    assert _greedy(fused) == _greedy(eager)
    assert _rebound(plain) == []  # running it changed nothing either


def test_enforce_eager_means_eager(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, **KW)
    assert llm.runner.stats()["compile"] == {"backend": "eager"}


@pytest.mark.parametrize("enabled, device, installed, want", [
    (None, "cpu", ("eager", "cpu_fused"), "cpu_fused"),
    (None, "cpu", ("eager",), "eager"),
    (None, "cuda", ("eager", "cpu_fused"), "eager"),
    (False, "cpu", ("eager", "cpu_fused"), "eager"),
    (True, "cpu", ("eager", "cpu_fused", "inductor"), "inductor"),
])
def test_the_default_backend(enabled, device, installed, want):
    assert CompileConfig(enabled=enabled).backend_for(torch.device(device), installed) == want


def test_eager_takes_no_options(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"the eager backend has no option 'decode_graphs'"):
        LLM(str(tiny_llama_dir), compile=False, compile_options={"decode_graphs": False}, **KW)


def test_unhooked_calls_still_run_hooks():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    assert skip_call_machinery(model) == 3 and skip_call_machinery(model) == 0
    assert type(model[0]).__name__ == "Linear" and isinstance(model[0], torch.nn.Linear)
    seen = []
    handle = model[0].register_forward_hook(lambda module, args, out: seen.append(out.shape))
    x = torch.randn(2, 4)
    model(x)
    handle.remove()
    model(x)
    assert seen == [torch.Size([2, 4])]
