"""One real daemon for the validation tests, serving the demo model three ways on cpu:0.

``smollm2-fp32`` and ``smollm2-bf16`` are the demo model at two dtypes (the reference and
the column under test); ``smollm2-perturbed`` is a copy of its weights with a little noise
added to every linear layer: a real engine computing a slightly different model, the
negative control of the numerics rows.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.daemons import BIN, PATIENT, Daemon, Daemons, Profile

__all__ = ["BIN"]

SPEC = """\
model: {model}
name: {name}
dtype: {dtype}
max_num_seqs: 8
max_model_len: 1024
kv_cache_memory_mb: 96
"""
WORKLOADS = ("smollm2-fp32", "smollm2-bf16", "smollm2-perturbed")
SOURCES = (("smollm2", "fp32"), ("smollm2", "bf16"), ("{home}/perturbed", "fp32"))
THREE_WAYS = Profile("validate-home", tuple(
    SPEC.format(model=model, name=name, dtype=dtype)
    for name, (model, dtype) in zip(WORKLOADS, SOURCES, strict=True)
), files=(PATIENT,), demo=True)  # fmt: skip
"""The demo model at two dtypes, and its perturbed copy (:func:`perturbed_copy`) in the home."""
PERTURBATION = 0.25
"""Noise added to each linear weight, as a fraction of that weight's standard deviation."""


def perturbed_copy(source: Path, target: Path, scale: float = PERTURBATION) -> Path:
    """``source`` (an HF model directory) with Gaussian noise added to its linear layers."""
    import torch
    from safetensors.torch import load_file, save_file

    target.mkdir(parents=True)
    for path in source.iterdir():
        if path.name not in ("model.safetensors", "kunlun-import.json"):
            shutil.copy(path, target / path.name)
    tensors = load_file(source / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name, tensor in tensors.items():
        if tensor.ndim == 2 and "embed_tokens" not in name:
            noise = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
            tensor += noise * tensor.std() * scale
    save_file(tensors, target / "model.safetensors")
    return target


@pytest.fixture(scope="module")
def platform(models_home: Path, request: pytest.FixtureRequest) -> Iterator[Daemon]:
    """A daemon with the three workloads RUNNING (one replica each on cpu:0)."""
    daemons = Daemons(request)
    home = daemons.home(THREE_WAYS)
    perturbed_copy(models_home / "models" / "smollm2", home / "perturbed")
    with daemons.serve(THREE_WAYS, home) as daemon:
        yield daemon


def validate(daemon: Daemon, *args: str, timeout: float = 1200) -> subprocess.CompletedProcess[str]:
    """``kunlun-cli validate ARGS`` as a subprocess (KUNLUN_ENDPOINT set to ``daemon``)."""
    return daemon.cli("validate", *args, timeout=timeout)
