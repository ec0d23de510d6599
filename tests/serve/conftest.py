"""Fixtures for the server tests: a tiny checkpoint, and real ``modelrunner serve`` processes on
127.0.0.1 with an ephemeral port, driven over HTTP (the official ``openai`` client and httpx)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

START_TIMEOUT_S = 180
"""Longest a server may take to print its address and load its model (2 busy cores)."""
LISTENING = re.compile(r"^modelrunner: serving (\S+) on (http://[\d.]+:(\d+))")


class ServerProcess:
    """One ``python -m modelrunner.cli serve --port 0 ...`` process.

    :param args: the options after ``serve``.
    :param api_key: the key the server requires (for :meth:`client`).
    :param env: extra environment variables.
    """

    def __init__(self, args: list[str], api_key: str | None = None, env: dict[str, str] | None = None) -> None:
        self.api_key = api_key
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                    "OMP_WAIT_POLICY": "PASSIVE", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "modelrunner.cli", "serve", "--port", "0", *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=full_env)
        self.lines: list[str] = []
        self.url = ""
        self._listening = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            match = LISTENING.match(line)
            if match:
                self.url = match.group(2)
                self._listening.set()
        self._listening.set()

    @property
    def stderr(self) -> str:
        """Everything the server wrote to stderr so far."""
        return "\n".join(self.lines)

    def wait_listening(self, timeout: float = START_TIMEOUT_S) -> str:
        """Wait for the "serving ... on URL" line; the URL."""
        assert self._listening.wait(timeout), f"no 'serving' line within {timeout} s:\n{self.stderr}"
        assert self.url, f"the server exited before listening (status {self.proc.poll()}):\n{self.stderr}"
        return self.url

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> ServerProcess:
        """Wait until ``/health`` answers 200."""
        self.wait_listening(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited with {self.proc.returncode}:\n{self.stderr}"
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"/health did not answer 200 within {timeout} s:\n{self.stderr}")

    @contextlib.contextmanager
    def serving(self):
        """The ready server for a ``with`` block (a module fixture's body); on leaving it, the server
        must stop with status 0 and no traceback on stderr."""
        try:
            yield self.wait_ready()
        finally:
            assert self.stop() == 0, self.stderr
            assert "Traceback" not in self.stderr, self.stderr

    def headers(self) -> dict[str, str]:
        """The authorization header, when the server has a key."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs):
        """An ``openai.OpenAI`` client for this server."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0, **kwargs)

    def async_client(self, **kwargs):
        """An ``openai.AsyncOpenAI`` client for this server."""
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0,
                                  **kwargs)

    def post(self, path: str, json=None, **kwargs) -> httpx.Response:
        """POST with the server's key."""
        headers = {**self.headers(), **kwargs.pop("headers", {})}
        return httpx.post(self.url + path, json=json, headers=headers, timeout=kwargs.pop("timeout", 60), **kwargs)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{sample name (with labels but model_name): value}``."""
        from prometheus_client.parser import text_string_to_metric_families

        values = {}
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=10).text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
                values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
        return values

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Send ``sig`` and wait for the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            self._reader.join(5)


@pytest.fixture(scope="session")
def serve_tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer (49152 tokens, ChatML template) saved as a directory.

    (Read through modelrunner's own source, which also works when SmolLM2 is a GGUF file read natively.)
    """
    from modelrunner.loading.source import resolve_source

    path = tmp_path_factory.mktemp("smollm2-tokenizer")
    resolve_source("smollm2").load_tokenizer().save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def serve_tokenizer(serve_tokenizer_dir: Path):
    """SmolLM2's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(serve_tokenizer_dir))


@pytest.fixture(scope="session")
def serve_llama_dir(tmp_path_factory, serve_tokenizer) -> Path:
    """A 2-layer random Llama (hidden 64, 4 heads, 2 kv heads: splits over 2 ranks) with SmolLM2's
    tokenizer and chat template, and weights far from HF's tiny init so greedy choices are stable."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = serve_tokenizer
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=2048,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("serve-llama")
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


TINY_CONFIG = ["--set", "dtype=float32", "--set", "max_model_len=2048", "--set", "kv_cache_memory=16777216"]
"""Config of every tiny-model server (and of the offline reference in the test process)."""
TINY_LLM_CONFIG = dict(dtype="float32", max_model_len=2048, kv_cache_memory=16 << 20)
"""The same, as ``LLM`` keywords."""
TINY_ENV = {"OMP_NUM_THREADS": "1"}
"""Tiny models run best on one thread (and leave the other core to the tests)."""


FAULTS_PLUGIN = '''
"""Test-only faults: a forward over the token ids POISON (three in a row, which no sampled batch
holds by chance) fails, so that request alone fails after its lone retry; once the file named by
SERVE_TEST_FATAL_FILE exists, every forward raises FatalError."""
import os

from modelrunner import hookimpl
from modelrunner.errors import FatalError

POISON = (49001, 49002, 49003)
FATAL_FILE = os.environ.get("SERVE_TEST_FATAL_FILE", "")


@hookimpl(wrapper=True)
def forward(batch):
    if FATAL_FILE and os.path.exists(FATAL_FILE):
        raise FatalError("injected fatal error: the accelerator fell off the bus")
    ids = batch.input_ids
    if len(ids) >= 3 and bool(((ids[:-2] == POISON[0]) & (ids[1:-1] == POISON[1]) & (ids[2:] == POISON[2])).any()):
        raise RuntimeError("injected failure: poisoned prompt")
    return (yield)
'''


@pytest.fixture(scope="session")
def faults_plugin_path(tmp_path_factory) -> Path:
    """A directory for ``PYTHONPATH`` holding the ``serve-test-faults`` plugin distribution."""
    from plugin_dists import make_distribution

    return make_distribution(tmp_path_factory.mktemp("faults"), "serve-test-faults", "serve_test_faults",
                             "serve_test_faults", FAULTS_PLUGIN)


POISON = [49001, 49002, 49003]
"""A prompt the faults plugin fails."""


def pythonpath_with(path: Path) -> str:
    """``PYTHONPATH`` with ``path`` first."""
    return os.pathsep.join(p for p in (str(path), os.environ.get("PYTHONPATH", "")) if p)


@pytest.fixture(scope="session")
def misbehaving_plugin_path(tmp_path_factory) -> Path:
    """A directory for ``PYTHONPATH`` holding the ``serve-test-misbehaving`` plugin distribution: a slow
    grammar backend and a proposer that blocks, proposes endlessly or mutates (see misbehaving_plugin.py)."""
    from plugin_dists import make_distribution

    source = (Path(__file__).parent / "misbehaving_plugin.py").read_text()
    return make_distribution(tmp_path_factory.mktemp("misbehaving"), "serve-test-misbehaving",
                             "serve_test_misbehaving", "serve_test_misbehaving", source)
