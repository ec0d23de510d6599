"""Scripts written for vLLM's offline API (its examples' style) run with only the import changed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).with_name("scripts")


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.py")))
def test_script_runs(script, smollm2_dir):
    source = (SCRIPTS / script).read_text()
    assert "import vllm" not in source and "from modelrunner import" in source
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    result = subprocess.run([sys.executable, str(SCRIPTS / script)], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip(), "the script printed nothing"
    print(result.stdout[-1500:])
