"""Quantization through the kernel's layers, without adapter code: tiny Llama and MoE models quantized
at load (``int8``, ``int4``), and a GGUF file's blocks, run end to end, and two tensor-parallel gloo
ranks (experts split whole, row-parallel layers split along whole groups) match one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modelrunner import LLM, SamplingParams
from modelrunner.layers.linear import LinearBase
from modelrunner.parallel_state import ParallelState
from modelrunner_quantization.experts import QuantizedExperts
from modelrunner_quantization.kernels import layout_of
from modelrunner_kit.testing import PagedDriver, load_adapter

from gloo_ranks import run_ranks

from moe.checkpoints import make_config, make_reference, save_checkpoint
from .gguf_files import tiny_llama, write_llama_gguf



def quant_cpu():
    """The quant-cpu plugin's helpers when its kernels load here, else None (tests may import it by name)."""
    try:
        import modelrunner_quant_cpu as plugin
    except ImportError:
        return None
    return plugin if plugin.available() else None


PROMPTS = {0: [5, 9, 2, 77, 31, 8, 100], 1: [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]}
CASES = [("llama", "int8"), ("llama", "int4"), ("mixtral", "int4"), ("qwen3_moe", "int8"), ("gguf", "gguf")]


def _logits(path: str, method: str, parallel: ParallelState | None = None) -> torch.Tensor:
    # Exact kernels (float activations): quantized activations would take their scales over each
    # rank's share of a row-parallel input, not the whole row.
    options = {"int4": {"group_size": 32, "activations": "float"}, "int8": {"activations": "float"},
               "gguf": {"activations": "float"}}.get(method, {})
    model = load_adapter(path, {"quantization": method, "quantization_options": options, "block_size": 4},
                         parallel=parallel)
    driver = PagedDriver(model.forward, model.loaded.kv_cache_spec, num_blocks=32)
    prefill = driver.step(PROMPTS, all_logits=True)
    return torch.cat([prefill, driver.step({0: [11], 1: [12]}, all_logits=True)])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_llama_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("quantized")
    paths = {"llama": str(tiny_llama_dir)}
    for name in ("mixtral", "qwen3_moe"):
        paths[name] = str(save_checkpoint(make_reference(make_config(name)), root / name))
    paths["gguf"] = str(write_llama_gguf(tiny_llama(vocab=49152, tie=True), root / "tiny.gguf"))
    return paths


def _worker(rank: int, world: int, root: str, paths: dict[str, str]) -> None:
    import torch.distributed as dist

    parallel = ParallelState(tp_rank=rank, tp_size=world, tp_group=dist.group.WORLD)
    for arch, method in CASES:
        logits = _logits(paths[arch], method, parallel)
        if rank == 0:
            torch.save(logits, f"{root}/{arch}-{method}.pt")


def test_two_ranks_match_one_process(tmp_path, checkpoints):
    run_ranks(_worker, 2, str(tmp_path / "rendezvous"), str(tmp_path), checkpoints)
    for arch, method in CASES:
        one = _logits(checkpoints[arch], method)
        two = torch.load(tmp_path / f"{arch}-{method}.pt")
        diff = (one - two).abs().max().item()
        print(f"{arch} {method}: tp=2 vs one process max |logits diff| = {diff:.2e}")
        assert diff <= 1e-4


@pytest.mark.parametrize("arch, method", [c for c in CASES if c[0] != "gguf"])
def test_quantized_models_generate_and_cover_every_layer(checkpoints, arch, method):
    options = {"group_size": 32} if method == "int4" else {}
    llm = LLM(checkpoints[arch], quantization=method, quantization_options=options, kv_cache_memory=2**22,
              block_size=4)
    stats = llm.runner.stats()
    assert stats["weights"]["quantization"] == method
    model = llm.runner.loaded.model
    experts = [m for m in model.modules() if hasattr(m, "w13_weight")]
    assert all(isinstance(m.quant_scheme, QuantizedExperts) for m in experts)
    assert all(m.w13_weight.dtype in (torch.int8, torch.uint8) for m in experts)
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.weight.dtype in (torch.int8, torch.uint8) for m in linears)
    assert stats["quantization"]["layers"] == len(linears) + len(experts)
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(max_tokens=8, temperature=0,
                                                                          ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("arch", ["gguf", "mixtral"])
def test_the_kernels_are_chosen_for_the_engines_dtype(checkpoints, arch):
    method = "gguf" if arch == "gguf" else "int4"
    for dtype in (torch.bfloat16, torch.float32):
        model = load_adapter(checkpoints[arch], {"quantization": method, "block_size": 4}, dtype=dtype)
        selectors = {id(m.quant_scheme.kernels): m.quant_scheme.kernels for m in model.loaded.model.modules()
                     if hasattr(getattr(m, "quant_scheme", None), "kernels")}
        assert selectors and all(s.dtype == dtype for s in selectors.values())


def test_int8_activations_are_quantized_per_token(checkpoints):
    # A token's logits do not depend on what else is in its batch (one scale per row, not per batch).
    model = load_adapter(checkpoints["llama"], {"quantization": "int8", "block_size": 4,
                                                "quantization_options": {"activations": "int8"}})
    down = model.loaded.model.model.layers[0].mlp.down_proj
    kernels = set(down.quant_scheme.kernels.choices.values())
    plugin = quant_cpu()
    if plugin is not None and plugin.p16_supported(8):  # 8-bit p16 needs VNNI
        assert kernels == {"cpu_p16"}, kernels  # cpu_q8's arithmetic, on storage regrouped in place
        assert layout_of(down) == "p16" and down.weight.packed_by.name == "cpu_p16"
    elif plugin is not None:
        assert kernels == {"cpu_q8"}, kernels
    else:
        assert kernels == {"int8_rowwise"}, kernels
    alone = PagedDriver(model.forward, model.loaded.kv_cache_spec, num_blocks=32).step({0: PROMPTS[0]})
    other = {1: [40000, 7, 7, 123, 9000, 5, 5, 44]}  # same size bucket (15 rows in all), same kernels
    batch = PagedDriver(model.forward, model.loaded.kv_cache_spec, num_blocks=32).step({0: PROMPTS[0], **other})
    assert (alone[0] - batch[0]).abs().max().item() < 1e-5
    exact = _logits(checkpoints["llama"], "int8")
    approx = PagedDriver(model.forward, model.loaded.kv_cache_spec, num_blocks=32).step(PROMPTS, all_logits=True)
    assert (approx - exact[: approx.shape[0]]).abs().max().item() < 0.05 * exact.abs().max().item()


@pytest.mark.parametrize("activations", ["float", "int8"])
def test_traced_layers_read_their_storage_and_match_eager(checkpoints, activations, monkeypatch):
    # Under torch.compile a layer calls its kernel with its own parameters (no closure of the bound
    # storage), and computes what the eager call does, in one graph (a trace that reached the plugin's
    # library loading broke the graph at every quantized layer: inductor ran 0.44x eager).
    from modelrunner_quantization.kernels import KernelSelector

    traced_layers: list[object] = []
    traced = KernelSelector.traced

    def counting(self, scheme, layer, x):
        traced_layers.append(layer)
        return traced(self, scheme, layer, x)

    monkeypatch.setattr(KernelSelector, "traced", counting)
    model = load_adapter(checkpoints["llama"], {"quantization": "int8", "block_size": 4,
                                                "quantization_options": {"activations": activations}})
    mlp = model.loaded.model.model.layers[0].mlp
    x = torch.randn(3, mlp.gate_up_proj.input_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = mlp(x)
        torch._dynamo.reset()
        compiled = torch.compile(mlp, backend="eager", fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    assert {id(m) for m in traced_layers} == {id(mlp.gate_up_proj), id(mlp.down_proj)}  # the traced path ran


def test_exact_kernels_agree_and_each_shape_keeps_one_family(checkpoints):
    # Float activations have kernels on planar and on p16 storage: they compute the same numbers
    # (up to float32 rounding), and a timed choice gives each shape one family for both row
    # buckets, with its storage in that family's layout.
    plugin = quant_cpu()
    if plugin is None or not plugin.p16_exact_supported(8):
        pytest.skip("no exact p16 kernel in this build")
    logits = {}
    exact = ["cpu_exact", "cpu_p16_exact"] + (["cpu_p16_split"] if plugin.p16_split_supported(8) else [])
    for kernel in exact:
        model = load_adapter(checkpoints["llama"], {"quantization": "int8", "block_size": 4, "quantization_options":
                                                    {"activations": "float", "kernel": kernel}})
        logits[kernel] = PagedDriver(model.forward, model.loaded.kv_cache_spec, num_blocks=32).step(
            PROMPTS, all_logits=True)
    scale = logits["cpu_exact"].abs().max().item()
    for kernel in exact[1:]:
        assert (logits["cpu_exact"] - logits[kernel]).abs().max().item() <= 1e-5 * scale, kernel
    model = load_adapter(checkpoints["llama"], {"quantization": "int8", "block_size": 4,
                                                "quantization_options": {"activations": "float"}})
    linears = [m for m in model.loaded.model.modules() if isinstance(m, LinearBase)]
    selector = linears[0].quant_scheme.kernels
    assert selector.families  # two families could run every shape: one was chosen by timing
    for layer in linears:
        chosen = {selector._choice(layer.quant_scheme, layer, b) for b in ("decode", "batch")}
        family = {selector.family_of(name) for name in chosen}
        assert len(family) == 1 and family.pop().startswith("float"), chosen
        layouts = {selector.candidates[name].layout for name in chosen}
        assert layouts == {layout_of(layer)}, (chosen, layer.weight.shape)


def test_a_gated_mlps_projections_take_one_family_chosen_over_both(checkpoints, monkeypatch, tmp_path):
    # Timed alone, gate_up would take the float family (1.0 against 1.1) and down the int8 one
    # (2.0 against 1.0), and the fused one-call MLP could not run. A module's fused_projections are
    # chosen together: int8, 2.1 against 3.0 summed over both.
    from modelrunner_quantization.kernels import KernelSelector

    plugin = quant_cpu()
    if plugin is None:
        pytest.skip("the quant-cpu kernels did not load here: one family only")

    def measure(self, scheme, layer, bucket_name, names):
        down = layer.weight.logical_shape[0] < layer.weight.logical_shape[1]
        cost = {"float": 2.0, "int8": 1.0} if down else {"float": 1.0, "int8": 1.1}
        # bf16 (torch's int8 op) slowest: the choice stays between float and int8
        return {n: cost.get(self.family_of(n).split("-")[0], 9.0) + 0.01 * i for i, n in enumerate(names)}

    monkeypatch.setattr(KernelSelector, "_measure", measure)
    monkeypatch.setenv("MODELRUNNER_CACHE_DIR", str(tmp_path))  # no choice read back from earlier runs
    model = load_adapter(checkpoints["llama"], {"quantization": "int8", "block_size": 4,
                                                "quantization_options": {"activations": "auto"}})
    for layer in model.loaded.model.model.layers:
        mlp = layer.mlp
        selector = mlp.gate_up_proj.quant_scheme.kernels
        families = {selector.family_of(selector._choice(proj.quant_scheme, proj, bucket))
                    for proj in (mlp.gate_up_proj, mlp.down_proj) for bucket in ("decode", "batch")}
        assert len(families) == 1 and families.pop().startswith("int8"), families


@pytest.mark.parametrize("kernel", ["cpu_p16", "cpu_p16_exact", "cpu_p16_split"])
def test_a_gated_mlp_on_p16_weights_is_one_call_with_the_same_numbers(checkpoints, kernel):
    from modelrunner_compile_cpu_fused.fused_ops import gated_mlp, gated_mlp_call, gated_mlp_fusable

    plugin = quant_cpu()
    supported = {"cpu_p16": "p16_supported", "cpu_p16_exact": "p16_exact_supported",
                 "cpu_p16_split": "p16_split_supported"}
    if plugin is None or not getattr(plugin, supported[kernel])(4):
        pytest.skip(f"no {kernel} kernel in this build")
    activations = "int8" if kernel == "cpu_p16" else "float"
    model = load_adapter(checkpoints["llama"], {"quantization": "int4", "block_size": 4, "quantization_options":
                                                {"group_size": 32, "activations": activations, "kernel": kernel}})
    mlp = model.loaded.model.model.layers[0].mlp
    for rows in (1, 40):
        x = torch.randn(rows, mlp.gate_up_proj.input_size, generator=torch.Generator().manual_seed(rows))
        assert gated_mlp_fusable(mlp) and gated_mlp_call(mlp, x) is not None
        with torch.no_grad():
            assert torch.equal(gated_mlp(mlp, x), mlp(x))  # the cpu_fused backend's one call, the plain layers
    handle = mlp.down_proj.register_forward_hook(lambda *args: None)  # a hook on a part: it must run
    assert gated_mlp_call(mlp, x) is None
    handle.remove()
    assert gated_mlp_call(mlp, x.t().contiguous().t()) is None  # not contiguous: the layers one by one


def test_bad_quantization_settings_are_refused_by_name(checkpoints):
    with pytest.raises(ValueError, match=r"int4 group_size must be 32, 64 or 128, got 48"):
        LLM(checkpoints["llama"], quantization="int4", quantization_options={"group_size": 48})
    with pytest.raises(ValueError, match=r"quantization 'int8' has no option 'group'.*options: activations, lm_head"):
        LLM(checkpoints["llama"], quantization="int8", quantization_options={"group": 32})
    with pytest.raises(ValueError, match=r"quantization 'gguf' runs \.gguf files"):
        LLM(checkpoints["llama"], quantization="gguf")
    with pytest.raises(ValueError, match=r"quantization 'int8' quantizes float checkpoints; .*tiny\.gguf is a GGUF file"):
        LLM(checkpoints["gguf"], quantization="int8")
    with pytest.raises(Exception, match=r"unknown quantization method 'int3'.*installed: .*gguf.*int4.*int8.*none"):
        LLM(checkpoints["llama"], quantization="int3")
    assert Path(checkpoints["gguf"]).is_file()
