"""Every installed attention backend through its conformance suite (one test per backend, one case per check)."""

from __future__ import annotations

import re

from modelrunner_kit.conformance import suite
from modelrunner.plugins import get_plugins

BACKENDS = get_plugins().attention_backends()

for _name in BACKENDS:
    globals()["test_" + re.sub(r"\W", "_", _name)] = suite("attention_backends", _name).as_pytest()


def test_the_kernel_and_plugin_backends_are_checked():
    assert {"torch_sdpa", "cpu_paged"} <= set(BACKENDS)
