"""Fixtures for the compile-backend tests: every installed backend, compiled once per session on the tiny Llama."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .helpers import greedy_texts, make_llm


@pytest.fixture(scope="session")
def eager_llm(tiny_llama_dir: Path) -> Any:
    """The reference: the tiny Llama run eagerly."""
    return make_llm(tiny_llama_dir, None)


@pytest.fixture(scope="session")
def eager_texts(eager_llm: Any) -> list[str]:
    """The eager greedy completions of :data:`PROMPTS`."""
    return greedy_texts(eager_llm)


@pytest.fixture(scope="session")
def compile_cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ``compile_cache_dir`` per backend lives under here for the whole session."""
    return tmp_path_factory.mktemp("compile-cache")


_compiled: dict[str, Any] = {}


@pytest.fixture(scope="session")
def compiled_llm(tiny_llama_dir: Path, compile_cache_root: Path):
    """``compiled_llm(backend)``: the tiny Llama under ``backend``, built once per session, its cache
    directory filled by the greedy generation of :data:`PROMPTS`; returns ``(llm, cache_dir, texts)``."""

    def get(backend: str) -> tuple[Any, Path, list[str]]:
        if backend not in _compiled:
            cache_dir = compile_cache_root / backend
            llm = make_llm(tiny_llama_dir, backend, cache_dir)
            _compiled[backend] = (llm, cache_dir, greedy_texts(llm))
        return _compiled[backend]

    return get
