"""``kunlun-cli plan`` as a user runs it, on recorded nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.planner.conftest import NODES, EditConfig

BIN = Path(sys.executable).parent


def cli(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNLUN_")}
    return subprocess.run(
        [str(BIN / "kunlun-cli"), "plan", *args],
        capture_output=True,
        text=True,
        env={**env, "KUNLUN_HOME": str(home)},
        timeout=120,
    )


def mixed(config: Path | None = None) -> list[str]:
    config = config or NODES / "mixed" / "device-plugin-config.yaml"
    return ["--replay", str(NODES / "mixed"), "--config", str(config)]


def test_plan_explain_prints_the_plan_and_every_rejected_alternative(tmp_path: Path) -> None:
    proc = cli("--model", "Llama-3-8B", "--quantization", "w8a8", *mixed(), "--explain",
               home=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "target_device ascend:" in out and "quantization: w8a8" in out
    assert "npu_rms_norm (torch_npu)" in out and "not wired into it" in out  # the plugin's
    assert "Rejected alternatives" in out
    for expected in ("cambricon:0-1", "nvidia:0", "dtype bf16 not in supported_dtypes",
                     "ranked lower by performance"):  # fmt: skip
        assert expected in out


def test_swapping_the_declared_int8_tops_swaps_the_plan(
    tmp_path: Path, edited_config: EditConfig
) -> None:
    """The mixed node as shipped and with the two pools' int8 TOPS exchanged (512 <-> 256)."""
    tops = {"ascend": 256, "cambricon": 512}

    def swap(device: dict[str, object]) -> None:
        device["int8_compute_power_tflops"] = tops.get(
            str(device["device_type"]), device["int8_compute_power_tflops"]
        )

    targets = {}
    for name, config in (("shipped", None), ("swapped", edited_config("mixed", swap))):
        proc = cli("--model", "Llama-3-8B", "--quantization", "w8a8", *mixed(config), "--json",
                   home=tmp_path)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        data = json.loads(proc.stdout)
        targets[name] = data["plan"]["device_type"]
    assert targets == {"shipped": "ascend", "swapped": "cambricon"}


def test_plan_json_for_a_pool(tmp_path: Path) -> None:
    proc = cli("--model", "Llama-3-8B", "--pool", "cambricon", "--dtype", "fp32", *mixed(),
               "--json", home=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    plan = data["plan"]
    assert plan["tensor_parallel_size"] == 2 and plan["devices"] == ["cambricon:0", "cambricon:1"]
    assert plan["env"]["MLU_VISIBLE_DEVICES"] == "0,1"
    assert plan["engine_options"] == {"graph_opt_level": "O3", "stream_priority": "high"}
    assert data["model"]["num_parameters"] == 8030261248
    assert any(a["tp"] == 1 and "usable" in a["reason"] for a in data["alternatives"])


def test_bad_requests_exit_2_naming_what_is_wrong(
    tmp_path: Path, edited_config: EditConfig
) -> None:
    def no_int8(device: dict[str, object]) -> None:
        if device["device_type"] == "nvidia":
            device["supported_dtypes"] = ["fp32", "fp16"]

    config = edited_config("mixed", no_int8)
    proc = cli("--model", "Llama-3-8B", "--quantization", "w8a8", "--device", "nvidia:0",
               *mixed(config), home=tmp_path)  # fmt: skip
    assert proc.returncode == 2
    assert (
        "quantization=w8a8 needs int8 but nvidia:0 has supported_dtypes ['fp16', 'fp32']"
        in proc.stderr
    )
    pool = cli("--model", "Llama-3-8B", "--pool", "kunlunxin", *mixed(), home=tmp_path)
    assert (
        pool.returncode == 2 and "no 'kunlunxin' devices" in pool.stderr and "ascend" in pool.stderr
    )
    spec = cli("--model", "Llama-3-8B", "--quantization", "w3", *mixed(), home=tmp_path)
    assert spec.returncode == 2 and "quantization" in spec.stderr and "'w3'" in spec.stderr
    unknown = cli("--model", "Llama-9", *mixed(), home=tmp_path)
    assert unknown.returncode != 0 and "Llama-9" in unknown.stderr and "Qwen3-8B" in unknown.stderr
