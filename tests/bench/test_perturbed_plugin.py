"""The deliberately wrong test backend stays out of everyone's way unless asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = """
import json
from modelrunner.plugins import get_plugins
p = get_plugins()
info = {i.name: i.as_dict() for i in p.list()}["perturbed_attention"]
print(json.dumps({"info": info, "backends": p.attention_backends("cpu"), "default": p.attention_backend("cpu").name}))
"""


def _probe(enabled: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MODELRUNNER_TEST_PERTURBED_ATTENTION"}
    if enabled:
        env["MODELRUNNER_TEST_PERTURBED_ATTENTION"] = "1"
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_registered_only_when_enabled_and_never_the_default():
    off = _probe(enabled=False)
    assert off["info"]["distribution"] == "modelrunner-perturbed-attention" and off["info"]["error"] is None
    assert off["info"]["provides"] == {} and "perturbed_sdpa" not in off["backends"]
    on = _probe(enabled=True)
    assert on["info"]["provides"] == {"attention_backends": ["perturbed_sdpa"]} and "perturbed_sdpa" in on["backends"]
    assert on["default"] == off["default"] != "perturbed_sdpa"


def test_it_changes_the_attention_output_slightly():
    import torch
    from modelrunner.layers import Attention, TorchSDPABackend
    from modelrunner_perturbed_attention import SCALE, PerturbedSDPABackend

    assert PerturbedSDPABackend.priority == -100 and issubclass(PerturbedSDPABackend, TorchSDPABackend)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 2, 8, generator=gen) for _ in range(3))
    layer = Attention(2, 8, 8**-0.5, 2, backend=TorchSDPABackend())
    from modelrunner.forward_batch import ForwardBatch

    batch = ForwardBatch(input_ids=torch.zeros(5, dtype=torch.long), positions=torch.arange(5), seq_ids=(0,),
                         query_start_loc=torch.tensor([0, 5]), seq_lens=torch.tensor([5]),
                         context_lens=torch.tensor([0]), slot_mapping=torch.arange(5),
                         block_tables=torch.tensor([[0, 1]]), logits_indices=torch.tensor([4]), block_size=4,
                         max_query_len=5, max_seq_len=5)
    outs = []
    for backend in (TorchSDPABackend(), PerturbedSDPABackend()):
        cache = torch.zeros(2, 2, 4, 2, 8)
        layer.backend = backend
        outs.append(layer(q, k, v, cache, backend.build_metadata(batch)))
    relative = (outs[1] - outs[0]).abs() / outs[0].abs().clamp_min(1e-6)
    assert 0 < float(relative.max()) <= SCALE + 1e-5
