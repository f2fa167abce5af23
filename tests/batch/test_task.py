"""The task file and flags: the seed's fields, flags win, errors name file:line and field."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kunlun.batch.task import load_task
from kunlun.errors import ConfigError

BIN = Path(sys.executable).parent

SEED_TASK = """\
# the seed's example (section 7.3)
task_name: model_inference_smoke
model_alias: your-model-alias
input_file: ./data/prompts.jsonl
output_dir: ./outputs
batch_size: 8
max_retries: 3
timeout_seconds: 120
"""

NO_FLAGS: dict[str, object] = {}


def test_the_seed_example_loads_with_paths_relative_to_the_file(tmp_path: Path) -> None:
    config = tmp_path / "jobs" / "task.yaml"
    config.parent.mkdir()
    config.write_text(SEED_TASK)
    task = load_task(config, NO_FLAGS)
    assert task.task_name == "model_inference_smoke"
    assert task.model_alias == "your-model-alias"
    assert task.input_file == tmp_path / "jobs" / "data" / "prompts.jsonl"
    assert task.output_dir == tmp_path / "jobs" / "outputs"
    assert (task.batch_size, task.max_retries, task.timeout_seconds) == (8, 3, 120)


def test_flags_override_the_file(tmp_path: Path) -> None:
    config = tmp_path / "task.yaml"
    config.write_text(SEED_TASK)
    task = load_task(config, {"batch_size": 2, "model_alias": "smollm2", "max_retries": None})
    assert (task.batch_size, task.model_alias, task.max_retries) == (2, "smollm2", 3)


def test_flags_alone_are_enough_and_task_name_defaults_to_the_input_stem() -> None:
    task = load_task(
        None,
        {"model_alias": "m", "input_file": Path("in/My prompts.v2.jsonl"), "output_dir": Path("o")},
    )
    assert task.task_name == "My-prompts.v2"
    assert (task.batch_size, task.max_retries, task.timeout_seconds) == (8, 3, 120.0)


def test_errors_name_file_line_and_field(tmp_path: Path) -> None:
    config = tmp_path / "task.yaml"
    config.write_text(SEED_TASK.replace("batch_size: 8", "batch_size: 0") + "max_retrys: 2\n")
    with pytest.raises(ConfigError) as caught:
        load_task(config, NO_FLAGS)
    text = str(caught.value)
    assert f"{config}:6 (batch_size): Input should be greater than or equal to 1 (got 0)" in text
    assert f"{config}:9 (max_retrys): unknown field (did you mean 'max_retries'?)" in text


def test_a_bad_flag_is_named_as_the_flag(tmp_path: Path) -> None:
    config = tmp_path / "task.yaml"
    config.write_text(SEED_TASK)
    with pytest.raises(ConfigError) as caught:
        load_task(config, {"timeout_seconds": -1.0, "task_name": "a:b"})
    text = str(caught.value)
    assert "--timeout-seconds: Input should be greater than 0 (got -1.0)" in text
    assert "--task-name: String should match pattern" in text


def test_missing_fields_say_how_to_give_them(tmp_path: Path) -> None:
    config = tmp_path / "task.yaml"
    config.write_text("output_dir: out\n")
    with pytest.raises(ConfigError) as caught:
        load_task(config, NO_FLAGS)
    assert "missing 'model_alias': give it in the task file or as --model-alias" in str(
        caught.value
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("task_name: a\ntask_name: b\n", ":2 (task_name): field 'task_name' is given twice"),
        ("- a\n- b\n", ":1: a task file must be a mapping"),
        ("task_name: [a\n", "not valid YAML"),
    ],
)
def test_malformed_files(tmp_path: Path, text: str, expected: str) -> None:
    config = tmp_path / "task.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_task(config, NO_FLAGS)
    assert expected in str(caught.value)


def test_the_cli_exits_2_on_a_bad_task(tmp_path: Path) -> None:
    config = tmp_path / "task.yaml"
    config.write_text(SEED_TASK.replace("max_retries: 3", "max_retries: lots"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNLUN_")}
    proc = subprocess.run(
        [str(BIN / "kunlun-cli"), "batch", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"{config}:7 (max_retries)" in proc.stderr
    assert "lots" in proc.stderr
