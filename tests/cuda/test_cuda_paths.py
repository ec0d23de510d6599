"""The CUDA paths, on a GPU: every installed adapter, attention backend and compile backend through its
conformance suite with ``device="cuda"``, and the engine itself there: weights and KV cache on the GPU,
the KV cache sized from the GPU's memory, bfloat16, and a quantized GGUF file.

CI has no GPU, so every test here is skipped without one; on a GPU machine: ``pytest tests/cuda``.
transformers' reference runs on the CPU in float32, as in the CPU suites.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")

DEVICE = "cuda"


def _names(kind: str) -> list[str]:
    """The installed names of ``kind`` (none without a GPU: the tests are skipped anyway)."""
    if not torch.cuda.is_available():
        return []
    from modelrunner.plugins import get_plugins

    return get_plugins().registry.names(kind)


def _run(suite) -> None:
    """Run a conformance suite on the GPU: fail naming every failed check; skip, saying why, when the
    plugin declares no CUDA support (every check skipped)."""
    results = suite.run()
    failed = [f"{r.check}: {r.message}" for r in results if r.status == "failed"]
    assert not failed, f"{suite.title} on {DEVICE}:\n" + "\n".join(failed)
    if not any(r.status == "passed" for r in results):
        pytest.skip(f"{suite.title}: " + "; ".join(sorted({r.message for r in results})))


@pytest.mark.parametrize("architecture", _names("architectures"))
def test_adapters_conform_on_cuda(architecture):
    from modelrunner_kit.conformance import suite
    from modelrunner_kit.conformance.models import tiny_config
    from modelrunner.registry import FALLBACK_ARCHITECTURE

    if architecture != FALLBACK_ARCHITECTURE:
        try:
            tiny_config(architecture)
        except ValueError as e:  # LLaVA: checked below through images
            pytest.skip(f"the adapter suite has no tiny checkpoint of {architecture}: {e}")
    _run(suite("architectures", architecture, device=DEVICE))


@pytest.mark.parametrize("backend", _names("attention_backends"))
def test_attention_backends_conform_on_cuda(backend):
    from modelrunner_kit.conformance import suite

    _run(suite("attention_backends", backend, device=DEVICE))


@pytest.mark.parametrize("backend", _names("compile_backends"))
def test_compile_backends_conform_on_cuda(backend):
    from modelrunner_kit.conformance import suite

    _run(suite("compile_backends", backend, device=DEVICE))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from modelrunner_kit.conformance.models import tiny_checkpoint

    return tiny_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("cuda-llama"))


PROMPTS = [[5, 9, 2, 14, 3], [7] * 11, list(range(3, 30))]


def _greedy(llm, prompts, n=8):
    from modelrunner import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert all(not o.error for o in outs), [o.error for o in outs]
    return [list(o.outputs[0].token_ids) for o in outs]


def test_the_engine_keeps_weights_and_cache_on_the_gpu_and_sizes_the_cache_from_its_memory(tiny_llama):
    from modelrunner import LLM
    from modelrunner_kit.conformance.models import reference_greedy, reference_model

    llm = LLM(str(tiny_llama), device=DEVICE, dtype="float32", gpu_memory_utilization=0.05)
    runner = llm.runner.runner  # the executor's model runner (one process)
    assert runner.device.type == "cuda"
    where = {p.device.type for p in runner.loaded.model.parameters()}
    assert where == {"cuda"}, f"parameters on {where}"
    assert runner.kv_caches and {t.device.type for t in runner.kv_caches} == {"cuda"}
    # gpu_memory_utilization of the card, less the weights and activation peak, bounds the cache.
    total = torch.cuda.get_device_properties(0).total_memory
    cache = sum(t.numel() * t.element_size() for t in runner.kv_caches)
    assert 0.02 * total < cache <= 0.05 * total, (cache, total)
    reference = reference_model(tiny_llama)
    assert _greedy(llm, PROMPTS) == [reference_greedy(reference, p, 8) for p in PROMPTS]
    llm.shutdown()


def test_too_little_gpu_memory_is_refused_by_name(tiny_llama):
    from modelrunner import LLM

    with pytest.raises(Exception, match="gpu_memory_utilization"):
        LLM(str(tiny_llama), device=DEVICE, dtype="float32", gpu_memory_utilization=1e-6)


def test_bfloat16_on_cuda_runs_near_float32(tiny_llama):
    from modelrunner import LLM
    from modelrunner_kit.conformance.models import reference_logits, reference_model

    llm = LLM(str(tiny_llama), device=DEVICE, dtype="bfloat16", kv_cache_memory=1 << 26)
    assert llm.runner.stats()["dtype"] == {"asked": "bfloat16", "runs": "bfloat16", "why": "asked for"}
    assert {t.dtype for t in llm.runner.runner.kv_caches} == {torch.bfloat16}
    reference = reference_model(tiny_llama)
    for prompt in PROMPTS:
        got = llm.runner.forward(prompt)[0].float().cpu()
        want = reference_logits(reference, prompt)
        scale = want.abs().max().item()
        assert (got - want).abs().max().item() <= 0.05 * scale, prompt
    llm.shutdown()


def test_a_quantized_gguf_file_runs_on_cuda_as_on_the_cpu(tiny_llama, tmp_path):
    from modelrunner import LLM
    from modelrunner_kit.conformance.gguf import write_llama_gguf

    path = write_llama_gguf(tiny_llama, tmp_path / "tiny.gguf")
    gpu = LLM(str(path), device=DEVICE, dtype="float32", kv_cache_memory=1 << 26)
    cpu = LLM(str(path), device="cpu", dtype="float32", kv_cache_memory=1 << 26)
    assert gpu.runner.stats()["weights"]["quantization"] == cpu.runner.stats()["weights"]["quantization"]
    for prompt in PROMPTS:
        got, want = gpu.runner.forward(prompt)[0].cpu(), cpu.runner.forward(prompt)[0]
        assert (got - want).abs().max().item() <= 1e-3 * max(want.abs().max().item(), 1.0), prompt
    assert _greedy(gpu, PROMPTS) == _greedy(cpu, PROMPTS)
    gpu.shutdown()
    cpu.shutdown()


def test_llava_with_images_on_cuda_gives_transformers_greedy_tokens(tmp_path):
    from modelrunner import LLM, SamplingParams
    from modelrunner_kit.conformance.models import byte_tokenizer

    spec = importlib.util.spec_from_file_location("tiny_llava", Path(__file__).parents[1] / "mm" / "checkpoint.py")
    tiny_llava = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny_llava)
    byte_tokenizer().save_pretrained(str(tmp_path / "tokenizer"))
    reference, processor = tiny_llava.save_tiny_llava(tmp_path / "llava", tmp_path / "tokenizer")
    llm = LLM(str(tmp_path / "llava"), device=DEVICE, dtype="float32", block_size=4, max_num_batched_tokens=8,
              max_model_len=256, kv_cache_memory=4 << 20)
    requests = [("USER: <image>\nDescribe it. ASSISTANT:", [tiny_llava.random_image(1)]),
                ("Left <image> right <image>", [tiny_llava.random_image(2), tiny_llava.random_image(3)]),
                ("text only", [])]
    outputs = llm.generate([{"prompt": t, "images": i} if i else t for t, i in requests],
                           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for (text, images), output in zip(requests, outputs):
        assert output.error is None, output.error
        inputs = processor(text=text, images=images or None, return_tensors="pt")
        with torch.no_grad():
            want = reference.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert list(output.outputs[0].token_ids) == want[0, inputs["input_ids"].shape[1]:].tolist(), text
    llm.shutdown()
