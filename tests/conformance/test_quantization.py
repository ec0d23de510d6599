"""The kernel's quantization methods (``none``, ``gguf``, ``int8``, ``int4``) through the
quantization-method conformance suite, on tiny Llama and Mixtral checkpoints written once per session
(and, for ``gguf``, a GGUF file of the same Llama). The tensor-parallel check (a worker process) runs
for ``int4`` only: its row-parallel layers split along whole quantization groups.

Known kernel defects are strict xfails (:data:`KNOWN_DEFECTS`): fixing one turns its test into a
failure, so the mark is removed with the fix.
"""

from __future__ import annotations

import pytest
from modelrunner_kit.conformance import NotApplicable, suite

CASES = {
    "none": ("none", {"tensor_parallel": False}),
    "gguf": ("gguf", {"tensor_parallel": False}),
    "int8": ("int8", {"tensor_parallel": False}),
    # Activations quantized per 32-value block: still batch independent, within int8's tolerance.
    "int8-int8-activations": ("int8", {"tensor_parallel": False, "options": {"activations": "int8"}}),
    # Activations rounded to bfloat16 (torch's packed int4 / int8 ops): per row, so batch independent too.
    "int4-bf16-activations": ("int4", {"tensor_parallel": False, "options": {"activations": "bf16"}}),
    "int8-bf16-activations": ("int8", {"tensor_parallel": False, "options": {"activations": "bf16"}}),
    "int4": ("int4", {"tensor_parallel": True}),
}
"""Test id → (method, suite options)."""

KNOWN_DEFECTS: dict[tuple[str, str], str] = {}
"""(test id, check) → the defect that makes it fail today."""


def _params() -> list:
    params = []
    for case, (method, options) in CASES.items():
        for check in suite("quantization_methods", method, **options).checks():
            defect = KNOWN_DEFECTS.get((case, check.name))
            marks = [pytest.mark.xfail(reason=defect, strict=True, raises=AssertionError)] if defect else []
            params.append(pytest.param(case, check.name, id=f"{case}/{check.name}", marks=marks))
    return params


@pytest.fixture(scope="module")
def method_suites(tmp_path_factory):
    """Test id → its suite, built on first use over one checkpoint folder for the module."""
    root = tmp_path_factory.mktemp("quantization-conformance")
    built: dict[str, object] = {}

    def get(case: str):
        if case not in built:
            method, options = CASES[case]
            built[case] = suite("quantization_methods", method, root=root, **options)
        return built[case]

    return get


@pytest.mark.parametrize(("case", "check"), _params())
def test_method_conforms(method_suites, case, check):
    found = {c.name: c for c in method_suites(case).checks()}
    try:
        found[check].run()
    except NotApplicable as e:
        pytest.skip(str(e))


def test_gguf_is_checked_on_a_gguf_file_and_the_others_on_floats(method_suites):
    assert method_suites("gguf").subject.suffix == ".gguf"
    assert method_suites("int8").subject.is_dir()
    gguf = method_suites("gguf")
    model = gguf.quantized(gguf.subject).loaded.model
    kinds = {repr(m.quant_scheme) for m in model.modules() if getattr(m, "quant_scheme", None) is not None}
    assert kinds == {"int8 from Q8_0/g32 symmetric", "int4 from Q4_0/g32", "int4 from Q4_1/g32"}
