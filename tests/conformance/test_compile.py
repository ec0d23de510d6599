"""The installed compile backends through their conformance suite: parity with eager on a tiny
Llama, and no recompilation once every step shape was seen.

``inductor`` compiles three graphs from scratch for the suite (about a minute on two cores), so it
runs only with ``MODELRUNNER_CONFORMANCE_INDUCTOR=1``; ``tests/compile`` covers its parity and
recompiles on every run.
"""

from __future__ import annotations

import os
import re

import pytest
from modelrunner_kit.conformance import suite
from modelrunner.plugins import get_registry

BACKENDS = get_registry().names("compile_backends")
HEAVY = {"inductor": "MODELRUNNER_CONFORMANCE_INDUCTOR"}
"""Backend → the environment variable that turns its suite on."""
OPTIONS = {"inductor": {"batch_buckets": [4]}}
"""Backend → ``compile_options`` (one decode graph instead of one per bucket)."""


def _test(name: str):
    if name in HEAVY and not os.environ.get(HEAVY[name]):
        @pytest.mark.skip(reason=f"set {HEAVY[name]}=1 to run the {name} suite (it compiles from scratch)")
        def test_heavy_backend() -> None:
            """Not run by default."""

        return test_heavy_backend
    return suite("compile_backends", name, options=OPTIONS.get(name)).as_pytest()


for _name in BACKENDS:
    globals()["test_" + re.sub(r"\W", "_", _name)] = _test(_name)


def test_the_project_backends_are_installed():
    assert {"eager", "cpu_fused", "inductor", "aot", "counting"} <= set(BACKENDS)
