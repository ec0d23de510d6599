"""``modelrunner generate --image``, run as a user would, and the plugin's listing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from modelrunner import SamplingParams

from .checkpoint import random_image


def modelrunner(*args: str) -> subprocess.CompletedProcess:
    """Run the installed console script."""
    exe = shutil.which("modelrunner", path=os.path.dirname(sys.executable))
    assert exe, "the modelrunner console script is not installed next to this python"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})


def test_generate_with_an_image_file_streams_what_the_api_gives(tiny_llava, llava_llm, tmp_path):
    image = tmp_path / "picture.png"
    random_image(20).save(image)
    prompt = "USER: <image>\nWhat is it? ASSISTANT:"
    result = modelrunner("generate", "--model", str(tiny_llava[0]), "--max-tokens", "6", "--image", str(image),
                         "--set", "kv_cache_memory=4194304", prompt)
    assert result.returncode == 0, result.stderr
    expected = llava_llm.generate({"prompt": prompt, "images": [random_image(20)]},
                                  SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
    assert result.stdout == expected.outputs[0].text + "\n"


def test_a_file_that_is_not_an_image_is_a_one_line_error(tiny_llava, tmp_path):
    notes = tmp_path / "notes.png"
    notes.write_text("these are words, not pixels")
    result = modelrunner("generate", "--model", str(tiny_llava[0]), "--image", str(notes), "<image> hi")
    assert result.returncode == 2
    assert result.stderr.strip() == (f"modelrunner: error: --image {notes}: not an image file (Pillow recognises "
                                     "no image format in it)")


def test_plugin_is_listed_with_its_hooks_and_architecture():
    result = modelrunner("plugins", "--json")
    assert result.returncode == 0, result.stderr
    mm = next(p for p in json.loads(result.stdout) if p["name"] == "mm")
    assert mm["distribution"] == "modelrunner-mm" and mm["error"] is None
    assert {"load", "forward", "process_inputs", "parallelize"} <= set(mm["hooks"])
    assert mm["provides"]["architectures"] == ["LlavaForConditionalGeneration"]
