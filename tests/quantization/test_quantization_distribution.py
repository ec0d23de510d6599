"""The quantization methods are the ``modelrunner-quantization`` distribution: installed, it provides
``gguf``/``int8``/``int4`` and the torch kernels; blocked, the kernel alone still runs the default GGUF
model (dequantized, as ``quantization="none"``) and names what is missing for ``int8``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from modelrunner.plugins import get_plugins

WITHOUT = r"""
import json, sys
from modelrunner import LLM, SamplingParams
from modelrunner.errors import UnknownNameError

llm = LLM("smollm2", max_num_batched_tokens=256)
out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=6, temperature=0))[0].outputs[0]
try:
    LLM("smollm2", quantization="int8")
    refused = None
except UnknownNameError as e:
    refused = str(e)
print(json.dumps({"weights": llm.runner.stats()["weights"]["quantization"], "tokens": list(out.token_ids),
                  "refused": refused}))
"""


def test_the_distribution_provides_the_methods_and_kernels():
    plugins = get_plugins()
    provides = plugins.infos["quantization"].provides
    assert provides["quantization_methods"] == ["gguf", "int4", "int8"]
    assert {"reference", "int8_rowwise", "torch_int4pack", "onednn_bf16"} <= set(provides["matmul_kernels"])
    assert plugins.infos["quantization"].distribution == "modelrunner-quantization"
    assert plugins.infos["default-quantization"].provides == {"quantization_methods": ["none"]}


def test_without_it_a_gguf_file_runs_dequantized_and_int8_is_an_unknown_name():
    from modelrunner import LLM, SamplingParams

    env = {**os.environ, "MODELRUNNER_BLOCK_PLUGINS": "quantization"}
    result = subprocess.run([sys.executable, "-c", WITHOUT], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    alone = json.loads(result.stdout.strip().splitlines()[-1])
    assert alone["weights"] == "none"  # dense floats: no method kept the blocks
    assert alone["refused"] == ("unknown quantization method 'int8'; installed: none ('int8' comes with the "
                                "modelrunner-quantization distribution: pip install modelrunner-quantization)")
    dense = LLM("smollm2", quantization="none", max_num_batched_tokens=256)
    want = dense.generate(["The capital of France is"], SamplingParams(max_tokens=6, temperature=0))[0].outputs[0]
    assert alone["tokens"] == list(want.token_ids)
