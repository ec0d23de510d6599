"""The kernel's proposers through the proposer suite: every check passes, the acceptance check with
(nearly) every draft accepted on text that copies its prompt, which the suite's threshold is set from."""

from __future__ import annotations

import re

import pytest
from modelrunner_kit.conformance import suite


@pytest.mark.parametrize("name", ["ngram", "draft"])
def test_the_kernels_proposers_pass_with_high_acceptance_on_copied_text(name):
    results = {r.check: r for r in suite("proposers", name).run()}
    assert {r.status for r in results.values()} == {"passed"}, {c: r.message for c, r in results.items()}
    measured = re.fullmatch(r"(\d+) of (\d+) drafted tokens accepted \(\d+%\) on text that copies its prompt",
                            results["acceptance-on-copied-text"].message)
    assert measured, results["acceptance-on-copied-text"].message
    accepted, drafted = map(int, measured.groups())
    assert drafted >= 20 and accepted >= 0.9 * drafted
