"""``kunlun-cli rollout create --file``: a bad overrides file is refused before anything is
sent, naming the file (and line); nothing listens at the endpoint given."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from tests.daemons import BIN, free_port


def create_with(overrides: Path, home: Path) -> subprocess.CompletedProcess[str]:
    """``rollout create --file overrides`` against an endpoint where nothing listens."""
    env = dict(os.environ, KUNLUN_ENDPOINT=f"http://127.0.0.1:{free_port()}",
               KUNLUN_HOME=str(home))  # fmt: skip
    return subprocess.run(
        [str(BIN / "kunlun-cli"), "rollout", "create", "--workload", "chat", "--model", "m2",
         "--file", str(overrides)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("faults: {delay_ms: [1\n", ["overrides.yaml:2", "not valid YAML"]),
        ("- faults\n", ["overrides.yaml", "must be a mapping of workload spec fields, not list"]),
    ],
)
def test_a_bad_overrides_file_is_refused_naming_it(
    tmp_path: Path, text: str, words: list[str]
) -> None:
    overrides = tmp_path / "overrides.yaml"
    overrides.write_text(text)
    proc = create_with(overrides, tmp_path / "home")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr


def test_a_missing_overrides_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    proc = create_with(missing, tmp_path / "home")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert str(missing) in proc.stderr and "cannot read spec" in proc.stderr
