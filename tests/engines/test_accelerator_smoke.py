"""A real vLLM behind Kunlun on an NVIDIA GPU (``scripts/accelerator-smoke.sh``).

Marked ``accelerator``: it runs the script where there is an NVIDIA GPU and vLLM, and is
skipped elsewhere (these CPU machines), saying which is missing.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIPPED = 77


def missing() -> str | None:
    """What this machine lacks for the smoke test, or None."""
    if shutil.which("nvidia-smi") is None:
        return "no nvidia-smi (no NVIDIA GPU)"
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed"
    return None


@pytest.mark.accelerator
@pytest.mark.skipif(missing() is not None, reason=f"accelerator smoke: {missing()}")
def test_vllm_serves_through_kunlun_on_an_nvidia_gpu() -> None:
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "accelerator-smoke.sh"),
                           str(Path(sys.executable).parent)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)  # fmt: skip
    assert proc.returncode != SKIPPED, proc.stdout
    assert proc.returncode == 0 and "accelerator-smoke: PASS" in proc.stdout, (
        proc.stdout + proc.stderr
    )
