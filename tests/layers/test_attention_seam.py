"""The attention-backend seam (registration, default choice, unknown names) and what only the kernel's
``torch_sdpa`` does: splitting steps that mix decodes with longer queries. Correctness of every
backend is the conformance suite's (``tests/conformance/test_attention.py``)."""

from __future__ import annotations

import pytest
from modelrunner_kit.conformance.attention import CASES, paged_scenario
from modelrunner.errors import UnknownNameError
from modelrunner.layers import AttentionBackend
from modelrunner.layers.sdpa_attention import SDPASplitMetadata, TorchSDPABackend
from modelrunner.plugins import get_plugins

PLUGINS = get_plugins()


def test_backend_seam():
    assert "torch_sdpa" in PLUGINS.attention_backends()
    assert PLUGINS.registry.owner("attention_backends", "torch_sdpa") == "default-sdpa"
    # The default is the highest-priority backend that runs here.
    usable = [PLUGINS.attention_backend("cpu", name) for name in PLUGINS.attention_backends("cpu")]
    assert PLUGINS.attention_backend("cpu").name == max(usable, key=lambda b: b.priority).name
    with pytest.raises(UnknownNameError, match="unknown attention backend 'nope'; installed: .*torch_sdpa"):
        PLUGINS.attention_backend("cpu", "nope")
    assert issubclass(type(PLUGINS.attention_backend("cpu")), AttentionBackend)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window", [None, 3])
def test_sdpa_splits_steps_mixing_decodes_with_longer_queries(case, window):
    context_lens, query_lens = CASES[case]
    batch = paged_scenario(context_lens, query_lens, 4, 2).batch
    metadata = TorchSDPABackend().build_metadata(batch, (None, window))
    # Steps mixing decodes with longer queries run as two parts (decodes unpadded).
    assert isinstance(metadata, SDPASplitMetadata) == (1 in query_lens and max(query_lens) > 1)
    if isinstance(metadata, SDPASplitMetadata):
        rows = sorted(int(r) for rows, _ in metadata.parts for r in rows)
        assert rows == list(range(batch.num_tokens))  # every token in exactly one part
