"""The compile cache directory: namespaced by configuration, checked against its manifest, never unpickled."""

from __future__ import annotations

import json
import os
import warnings

import pytest

pytest.importorskip("modelrunner_compile_inductor")

from modelrunner_compile_inductor import CompileCache, CompileCacheWarning  # noqa: E402
from modelrunner_compile_inductor.cache import ENV_VAR, MANIFEST  # noqa: E402


def _filled(tmp_path, key=None):
    cache = CompileCache(tmp_path, "inductor", key or {"model": "tiny"})
    cache.check()
    (cache.path / "fxgraph" / "ab").mkdir(parents=True)
    (cache.path / "fxgraph" / "ab" / "entry").write_bytes(b"compiled graph")
    (cache.path / "kernel.so").write_bytes(b"\x7fELF...")
    cache.record()
    return cache


def test_namespaces_differ_by_key_and_stay_under_the_root(tmp_path):
    a = CompileCache(tmp_path, "inductor", {"dtype": "float32"})
    b = CompileCache(tmp_path, "inductor", {"dtype": "bfloat16"})
    assert a.path != b.path and a.path.parent == b.path.parent == tmp_path.resolve()
    assert a.path.name.startswith("inductor-")
    assert CompileCache(tmp_path, "inductor", {"dtype": "float32"}).path == a.path


def test_a_clean_directory_passes_the_check(tmp_path):
    _filled(tmp_path)
    again = CompileCache(tmp_path, "inductor", {"model": "tiny"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again.check()
    assert again.had_entries and again.removed_files == 0 and again.warnings == []
    manifest = json.loads((again.path / MANIFEST).read_text())
    assert set(manifest["files"]) == {"fxgraph/ab/entry", "kernel.so"}


def test_corrupt_and_foreign_files_are_removed_with_a_warning(tmp_path):
    cache = _filled(tmp_path)
    (cache.path / "kernel.so").write_bytes(b"\x7fELF.!.")  # same size, other bytes
    (cache.path / "fxgraph" / "ab" / "other").write_bytes(b"dropped in by someone else")
    again = CompileCache(tmp_path, "inductor", {"model": "tiny"})
    with pytest.warns(CompileCacheWarning, match=r"removed 1 corrupt \(e.g. kernel.so\) and 1 foreign "
                                                 r"\(e.g. fxgraph/ab/other\) file\(s\)"):
        again.check()
    assert not (cache.path / "kernel.so").exists() and not (cache.path / "fxgraph" / "ab" / "other").exists()
    assert (cache.path / "fxgraph" / "ab" / "entry").exists()
    assert again.removed_files == 2


def test_an_unreadable_manifest_makes_every_file_foreign(tmp_path):
    cache = _filled(tmp_path)
    (cache.path / MANIFEST).write_text("{not json")
    again = CompileCache(tmp_path, "inductor", {"model": "tiny"})
    with pytest.warns(CompileCacheWarning) as record:
        again.check()
    messages = [str(w.message) for w in record]
    assert any("manifest" in m and "unreadable" in m for m in messages)
    assert any("2 foreign" in m for m in messages)
    assert not any(p.is_file() for p in (cache.path / "fxgraph").rglob("*"))


def test_active_points_inductor_at_the_namespace_and_restores(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "/somewhere/else")
    cache = CompileCache(tmp_path, "inductor", {})
    with cache.active():
        assert os.environ[ENV_VAR] == str(cache.path)
    assert os.environ[ENV_VAR] == "/somewhere/else"
    with CompileCache(None, "inductor", {}).active():
        assert os.environ[ENV_VAR] == "/somewhere/else"



def test_the_attention_backend_is_part_of_the_key(tiny_llama_dir):
    # Compiled code calls the attention backend's kernels: a cache filled under one backend must not
    # serve a run that asked for another.
    from modelrunner import ModelRunner
    from modelrunner.plugins import get_plugins
    from modelrunner_compile_inductor.cache import model_identity

    identities = {}
    for backend in get_plugins().attention_backends("cpu"):
        runner = ModelRunner({"model": str(tiny_llama_dir), "attention_backend": backend})
        runner.load_model()
        identities[backend] = model_identity(runner.loaded, "inductor", "modelrunner-compile-inductor")
        assert identities[backend]["attention"][0].startswith(f"{backend} (")
    assert len({json.dumps(i, sort_keys=True) for i in identities.values()}) == len(identities)
