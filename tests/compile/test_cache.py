"""The compile cache persists across processes, and a corrupt or foreign file in it recompiles with a warning."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from .helpers import compile_backends, run_child

PERSISTENT = [name for name in compile_backends() if name in ("inductor", "aot")]

_filled: dict[str, tuple[Path, dict]] = {}


@pytest.fixture(scope="session")
def filled_cache(tiny_llama_dir, tmp_path_factory):
    """``filled_cache(backend)``: a cache directory filled by a first fresh process, and that
    process's result. Both processes of a test are fresh, so nothing the test session did to torch's
    global state can change the cache keys they compute."""

    def get(backend: str) -> tuple[Path, dict]:
        if backend not in _filled:
            cache_dir = tmp_path_factory.mktemp(f"filled-{backend}")
            result, _ = run_child(tiny_llama_dir, backend, cache_dir)
            _filled[backend] = (cache_dir, result)
        return _filled[backend]

    return get


@pytest.mark.parametrize("backend", PERSISTENT)
def test_second_process_loads_everything_from_the_cache(backend, filled_cache, eager_texts, tiny_llama_dir):
    cache_dir, first = filled_cache(backend)
    assert first["texts"] == eager_texts
    assert first["compile"]["graphs_from_scratch"] >= 1, first["compile"]

    result, _ = run_child(tiny_llama_dir, backend, cache_dir)
    stats = result["compile"]
    assert result["texts"] == eager_texts
    assert stats["graphs_from_scratch"] == 0, stats
    assert stats["graphs_from_cache"] >= 1, stats
    assert stats["cache_warnings"] == []


@pytest.mark.parametrize("backend", PERSISTENT)
def test_corrupt_and_foreign_files_recompile_with_a_warning(backend, filled_cache, eager_texts, tiny_llama_dir,
                                                             tmp_path):
    cache_dir, _ = filled_cache(backend)
    broken = tmp_path / "cache"
    shutil.copytree(cache_dir, broken)
    namespace = next(broken.iterdir())
    entries = [p for p in namespace.rglob("*") if p.is_file() and p.name != "modelrunner-manifest.json"
               and "locks" not in p.parts]
    assert entries
    for path in entries:  # every compiled artifact garbled, same size or not
        path.write_bytes(b"\x80\x04garbage" + path.read_bytes()[:64])
    (namespace / "stray.pt2").write_bytes(b"not ours")

    result, stderr = run_child(tiny_llama_dir, backend, broken)
    stats = result["compile"]
    assert result["texts"] == eager_texts
    assert stats["graphs_from_scratch"] >= 1, stats
    assert stats["cache_files_removed"] == len(entries) + 1
    (warning,) = stats["cache_warnings"]
    assert "corrupt" in warning and "foreign" in warning and "recompiled" in warning
    assert "CompileCacheWarning" in stderr
