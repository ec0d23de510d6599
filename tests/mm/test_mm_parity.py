"""The LLaVA adapter gives transformers' logits on the same weights, with the prompt prefilled in
chunks that start and end in the middle of an image's tokens."""

from __future__ import annotations

import attrs
import pytest
import torch

from modelrunner_kit.testing import PagedDriver, load_adapter

from .checkpoint import IMAGE_SEQ_LENGTH, random_image

TOLERANCE = 1e-4
"""Largest absolute logit difference accepted in float32."""

PROMPTS = {
    "one image": ("USER: <image>\nWhat is in the picture? ASSISTANT:", 1),
    "two images": ("Compare <image> with <image> please.", 2),
}


def _load(path):
    model = load_adapter(path)
    assert model.loaded.adapter == "mm"
    assert model.loaded.parts["language_model"].adapter == "llama"  # the text model came through the loader
    return model, model.loaded


@pytest.mark.parametrize("name", list(PROMPTS))
def test_logits_match_transformers_in_chunks(name, tiny_llava):
    path, reference, processor = tiny_llava
    text, count = PROMPTS[name]
    images = [random_image(seed) for seed in range(count)]
    expected_inputs = processor(text=text, images=images, return_tensors="pt")
    with torch.no_grad():
        expected = reference(**expected_inputs).logits[0]

    model, loaded = _load(path)
    token_ids, extra = model.process_inputs(text, loaded.tokenizer.encode(text), {"images": images})
    assert token_ids == expected_inputs["input_ids"][0].tolist()  # placeholders expanded as the processor does
    assert len(extra["image_positions"]) == count * IMAGE_SEQ_LENGTH
    torch.testing.assert_close(extra["pixel_values"], expected_inputs["pixel_values"])

    driver = PagedDriver(model.forward, loaded.kv_cache_spec, num_blocks=64)
    seq = 7
    first_image = int(extra["image_positions"][0])
    cuts = [0, first_image + 5, first_image + 11, len(token_ids)]  # chunks begin inside the image
    got = []
    for start, end in zip(cuts, cuts[1:]):
        batch = driver.build({seq: token_ids[start:end]}, all_logits=True)
        batch = attrs.evolve(batch, extra={k: {seq: v} for k, v in extra.items()})
        got.append(model.logits(batch, driver.kv_caches))
    got = torch.cat(got)
    diff = (got - expected).abs().max().item()
    print(f"{name}: max |logit diff| = {diff:.2e}")
    assert diff <= TOLERANCE
    # Each image was encoded once, at the first chunk that reached it; nothing is kept afterwards.
    assert loaded.model.runner_stats() == {"images_encoded": count, "sequences_with_image_features": 0}


def test_text_only_prompt_matches_transformers(tiny_llava):
    path, reference, processor = tiny_llava
    model, loaded = _load(path)
    tokens = loaded.tokenizer.encode("No picture here, just words.")
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor([tokens])).logits[0]
    token_ids, extra = model.process_inputs(None, tokens, {})
    assert (token_ids, extra) == (tokens, {})
    driver = PagedDriver(model.forward, loaded.kv_cache_spec, num_blocks=64)
    got = driver.step({0: tokens}, all_logits=True)
    assert (got - expected).abs().max().item() <= TOLERANCE


LAYOUTS = {
    # transformers' module names (what a checkpoint written without the legacy conversion holds)
    "modules": [("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector.")],
    # llava-hf's original checkpoints: the vision tower nested under vision_model
    "nested-vision": [("vision_tower.", "vision_tower.vision_model.")],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_other_checkpoint_layouts_load_the_same_model(layout, tiny_llava, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    path, reference, processor = tiny_llava
    for file in path.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, tmp_path / file.name)
    renamed = {}
    for name, tensor in load_file(str(path / "model.safetensors")).items():
        old, new = next(((o, n) for o, n in LAYOUTS[layout] if name.startswith(o)), (name, name))
        renamed[new + name[len(old):]] = tensor
    assert set(renamed) != set(load_file(str(path / "model.safetensors")))
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})

    text = "Look: <image>"
    images = [random_image(3)]
    inputs = processor(text=text, images=images, return_tensors="pt")
    with torch.no_grad():
        expected = reference(**inputs).logits[0]
    model, loaded = _load(tmp_path)
    token_ids, extra = model.process_inputs(text, loaded.tokenizer.encode(text), {"images": images})
    driver = PagedDriver(model.forward, loaded.kv_cache_spec, num_blocks=64)
    batch = attrs.evolve(driver.build({0: token_ids}, all_logits=True), extra={k: {0: v} for k, v in extra.items()})
    got = model.logits(batch, driver.kv_caches)
    assert (got - expected).abs().max().item() <= TOLERANCE
