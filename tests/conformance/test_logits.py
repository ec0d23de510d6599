"""The project's logits processors (the kernel's built-ins and the ``banned_words`` test plugin)
through their conformance suite, each with the example arguments its class declares."""

from __future__ import annotations

import re

from modelrunner_kit.conformance import suite
from modelrunner.plugins import get_plugins


PLUGINS = get_plugins()
PROCESSORS = PLUGINS.registry.names("logits_processors")

for _name in PROCESSORS:
    globals()["test_" + re.sub(r"\W", "_", _name)] = suite("logits_processors", _name).as_pytest()


def test_every_project_processor_has_examples():
    ours = set(PLUGINS.registry.by_plugin("default-sampling")["logits_processors"]) | {"banned_words"}
    assert ours <= set(PROCESSORS)
    missing = sorted(n for n in ours if not PLUGINS.logits_processor_class(n).example_args)
    assert not missing, f"processors without example_args: {missing}"
