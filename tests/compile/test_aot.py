"""The aot backend: its package binds the live model's weights (tied ones too); options and quantized
models fail clearly, at load."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("modelrunner_compile_aot")

from modelrunner_compile_aot import inductor_settings  # noqa: E402
from modelrunner_compile_aot.package import bind_weights  # noqa: E402


class _TiedHead(nn.Module):
    """An embedding and an output projection sharing one weight, like a tied LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def test_a_package_without_weights_runs_on_the_live_tied_weights(tmp_path):
    module = _TiedHead().eval()
    ids = torch.tensor([1, 5, 7])
    with torch.no_grad():
        program = torch.export.export(module, (ids,), strict=False)
    path = torch._inductor.aoti_compile_and_package(
        program, package_path=str(tmp_path / "tied.pt2"),
        inductor_configs={"aot_inductor.package_constants_in_so": False, "aot_inductor.metadata": {}})
    loaded = torch._inductor.aoti_load_package(path)
    bind_weights(loaded, module)
    with torch.no_grad():
        module.embed.weight.mul_(2.0)  # the package sees the live weights, not a copy
        expected = module(ids)
    assert torch.allclose(loaded(ids), expected, atol=1e-6)


def test_aot_options_name_the_bad_value():
    with pytest.raises(ValueError, match="compile_mode 'fast' is not a torch.compile mode; choose one of default"):
        inductor_settings("fast", {})
    with pytest.raises(ValueError, match="unknown aot compile option 'inductr'; did you mean 'inductor'"):
        inductor_settings("default", {"inductr": {}})
    with pytest.raises(ValueError, match="'max_autotun', which is not a torch._inductor.config setting"):
        inductor_settings("default", {"inductor": {"max_autotun": True}})
    assert inductor_settings("max-autotune", {}) == {"max_autotune": True, "coordinate_descent_tuning": True}


def test_a_quantized_model_is_refused_at_load_naming_a_layer(tiny_llama_dir):
    from modelrunner import LLM

    with pytest.raises(ValueError, match=r"the aot compile backend does not compile quantized layers \(\d+ here, "
                                         r"e\.g\. 'model\..*'\); use quantization='none'"):
        LLM(model=str(tiny_llama_dir), quantization="int8", compile=True, compile_backend="aot",
            kv_cache_memory=8 * 2**20)
