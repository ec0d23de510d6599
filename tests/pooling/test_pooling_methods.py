"""The pooling-method plugin kind: the kernel's methods pass their conformance suite, are listed and
routed by name, and a checkpoint's sentence-transformers modules choose the method and normalisation."""

from __future__ import annotations

import json

import pytest

from modelrunner_kit.conformance import suite
from modelrunner.plugins import get_plugins
from modelrunner.pooling import checkpoint_pooling

from .conftest import write_sentence_transformers

test_conformance_last = suite("pooling_methods", "last").as_pytest()
test_conformance_mean = suite("pooling_methods", "mean").as_pytest()
test_conformance_cls = suite("pooling_methods", "cls").as_pytest()


def test_builtin_methods_are_registered_and_unknown_names_list_them():
    plugins = get_plugins()
    assert plugins.registry.by_plugin("default-pooling") == {"pooling_methods": ["cls", "last", "mean"]}
    assert plugins.pooling_method_class("mean").reads == "all"
    assert plugins.registry.capabilities("pooling_methods", "last", "default-pooling") == {"reads": "last"}
    with pytest.raises(ValueError, match=r"unknown pooling method 'maen'; installed: cls, last, mean\. Did you mean 'mean'"):
        plugins.pooling_method_class("maen")


def test_sentence_transformers_modules_choose_method_and_normalisation(tmp_path):
    assert checkpoint_pooling(tmp_path).method is None  # nothing declared
    write_sentence_transformers(tmp_path, "mean", normalize=False)
    declared = checkpoint_pooling(tmp_path)
    assert (declared.method, declared.normalize) == ("mean", False)
    write_sentence_transformers(tmp_path, "lasttoken", normalize=True)
    assert (checkpoint_pooling(tmp_path).method, checkpoint_pooling(tmp_path).normalize) == ("last", True)
    # sentence-transformers < 5 wrote one flag per mode
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    assert checkpoint_pooling(tmp_path).method == "cls"
