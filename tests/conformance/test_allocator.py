"""Every installed KV-cache allocator through its conformance suite (the allocator contract), and
how allocators are found by name."""

from __future__ import annotations

import importlib.util
import re

import pytest
from modelrunner.config import CacheConfig
from modelrunner_kit.conformance import suite
from modelrunner.plugins import create_allocator, get_registry

ALLOCATORS = get_registry().names("allocators")

for _name in ALLOCATORS:
    globals()["test_" + re.sub(r"\W", "_", _name)] = suite("allocators", _name).as_pytest()


def test_kernel_and_installed_allocators_are_discovered() -> None:
    assert "paged" in ALLOCATORS
    if importlib.util.find_spec("modelrunner_kv_contiguous") is not None:
        assert "contiguous" in ALLOCATORS


def test_unknown_allocator_names_the_installed_ones() -> None:
    with pytest.raises(ValueError, match="paged") as excinfo:
        create_allocator("pagd", 8, 4, 16, CacheConfig())
    assert "'pagd'" in str(excinfo.value)
