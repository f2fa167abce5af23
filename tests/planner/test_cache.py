"""The plan cache key, entries, and the weights cast once for a plan."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tests.planner.conftest import MODELS, model, node

from kunlun.engine.convert import floating_dtypes, prepare_weights
from kunlun.planner.cache import PlanCache, model_fingerprint
from kunlun.workload.placement import place
from kunlun.workload.spec import WorkloadSpec


def checkpoint(root: Path) -> Path:
    """A small fp32 checkpoint with an integer tensor, a config and a tokenizer file."""
    root.mkdir()
    (root / "config.json").write_text((MODELS / "Qwen2-0.5B" / "config.json").read_text())
    (root / "tokenizer.json").write_text("{}")
    save_file({"w": torch.randn(8, 8), "ids": torch.arange(5)}, str(root / "model.safetensors"))
    return root


def test_entries_hit_on_the_same_model_and_devices_and_miss_on_a_changed_one(
    tmp_path: Path,
) -> None:
    model_dir = checkpoint(tmp_path / "m")
    inventory = node("mixed")
    placement = place(WorkloadSpec(model="Qwen2-0.5B"), inventory, model("Qwen2-0.5B"))
    plan, group = placement.plans[0], placement.groups[0]
    cache = PlanCache(tmp_path / "home")
    first = cache.entry(plan, model_dir, group)
    second = cache.entry(plan, model_dir, group)
    assert (first.hit, second.hit) == (False, True) and first.key == second.key
    assert json.loads((first.path / "plan.json").read_text())["devices"] == plan.devices
    inputs = json.loads((first.path / "key.json").read_text())
    assert inputs["devices"][0]["custom_attributes"] == {"aclnn_fusion_enabled": True}
    assert "memory_used_mb" not in inputs["devices"][0]  # volatile figures stay out of the key
    changed = [dataclasses.replace(group[0], custom_attributes={"aclnn_fusion_enabled": False})]
    assert not cache.entry(plan, model_dir, changed).hit
    other_dtype = dataclasses.replace(plan, dtype="fp16")
    assert not cache.entry(other_dtype, model_dir, group).hit


def test_the_fingerprint_follows_config_and_weight_files(tmp_path: Path) -> None:
    model_dir = checkpoint(tmp_path / "m")
    before = model_fingerprint(model_dir)
    assert model_fingerprint(model_dir) == before
    stat = (model_dir / "model.safetensors").stat()
    os.utime(model_dir / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    touched = model_fingerprint(model_dir)
    assert touched != before
    (model_dir / "tokenizer.json").write_text('{"changed": true}')  # not part of the key
    assert model_fingerprint(model_dir) == touched
    (model_dir / "config.json").write_text("{}")
    assert model_fingerprint(model_dir) != touched


def test_weights_are_cast_once_and_reused(tmp_path: Path) -> None:
    model_dir = checkpoint(tmp_path / "m")
    target = tmp_path / "entry" / "weights"
    loaded, line = prepare_weights(model_dir, target, "bf16")
    assert loaded == target and line.startswith("conversion: cast 2 tensors to bf16")
    assert floating_dtypes(target) == {"BF16"}
    with safe_open(str(target / "model.safetensors"), framework="pt") as handle:
        assert handle.get_tensor("ids").dtype == torch.int64  # integers are not cast
    assert (target / "config.json").resolve() == (model_dir / "config.json").resolve()
    written = (target / "model.safetensors").stat().st_mtime_ns
    again, line = prepare_weights(model_dir, target, "bf16")
    assert again == target and line.startswith("conversion: reused")
    assert (target / "model.safetensors").stat().st_mtime_ns == written
    same, line = prepare_weights(model_dir, tmp_path / "unused", "fp32")
    assert same == model_dir and line == "conversion: none (weights are already fp32)"
    assert not (tmp_path / "unused").exists()
