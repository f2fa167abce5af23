"""``kunlun-cli model import-gguf`` of crafted GGUF files, on ``KUNLUN_HOME`` and through a
real daemon: the daemon answers 400 naming the key or tensor, and the CLI exits 1 for a bad
file either way (2 for a usage error, 3 when the daemon cannot be reached), with one message
and no traceback.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from tests import loopback
from tests.daemons import Daemon, free_port
from tests.engine.gguf_bytes import (
    ARRAY,
    GGUF,
    KV,
    Q4_1,
    gguf_bytes,
    nested_array,
    tiny_llama,
)

Q_PROJ = "blk.0.attn_q.weight"


def zero_heads(model: GGUF) -> None:
    model.kv("llama.attention.head_count").value = 0


def huge_dims(model: GGUF) -> None:
    model.tensor(Q_PROJ).dims = [0, 2**62]


def partial_q4_1_block(model: GGUF) -> None:
    norm = model.tensor("output_norm.weight")
    norm.dims, norm.ggml_type, norm.data = [48], Q4_1, bytes(40)


def deep_arrays(model: GGUF) -> None:
    model.kvs.append(KV("general.nested", ARRAY, nested_array(50_000)))


# (id, change, the key or tensor the error names)
CRAFTED: list[tuple[str, Callable[[GGUF], None], str]] = [
    ("zero_heads", zero_heads, "llama.attention.head_count"),
    ("dims_0_2p62", huge_dims, Q_PROJ),
    ("q4_1_partial_block", partial_q4_1_block, "output_norm.weight"),
    ("arrays_nested_50000", deep_arrays, "general.nested"),
]


def crafted(folder: Path, change: Callable[[GGUF], None]) -> Path:
    model = tiny_llama()
    change(model)
    path = folder / "crafted.gguf"
    path.write_bytes(gguf_bytes(model))
    return path


def one_message(stderr: str, *needles: str) -> None:
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    for needle in needles:
        assert needle in lines[0], stderr


@pytest.mark.parametrize(
    ("change", "field"), [case[1:] for case in CRAFTED], ids=[case[0] for case in CRAFTED]
)
def test_daemon_answers_400_naming_the_field(
    bare_daemon: Daemon, tmp_path: Path, change: Callable[[GGUF], None], field: str
) -> None:
    path = crafted(tmp_path, change)
    answer = loopback.post(
        bare_daemon.url + "/api/v1/models/import-gguf",
        json={"path": str(path), "name": "crafted"},
        timeout=120,
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == field and field in error["message"] and str(path) in error["message"]
    assert error["code"].startswith("model.")
    assert bare_daemon.get("/healthz").status_code == 200
    assert bare_daemon.get("/api/v1/models").json() == []


def test_cli_exit_status_is_the_same_locally_and_through_the_daemon(
    bare_daemon: Daemon, tmp_path: Path
) -> None:
    path = crafted(tmp_path, zero_heads)
    local = Daemon(tmp_path / "local-home", bare_daemon.port)  # for its CLI on another home
    for daemon, remote in ((local, False), (bare_daemon, True)):
        proc = daemon.cli("model", "import-gguf", str(path), remote=remote)
        assert proc.returncode == 1, (remote, proc.stderr)
        one_message(proc.stderr, "llama.attention.head_count", str(path), "got 0")
        usage = daemon.cli("model", "import-gguf", remote=remote)  # neither PATH nor --demo
        assert usage.returncode == 2 and "give a GGUF PATH or --demo" in usage.stderr
    gone = Daemon(tmp_path / "gone-home", free_port())  # nothing listens on its port
    unreachable = gone.cli("model", "import-gguf", str(path))
    assert unreachable.returncode == 3
    one_message(unreachable.stderr, "cannot reach the Kunlun daemon")


def test_daemon_import_takes_the_output_form_and_checks_it(
    bare_daemon: Daemon, tmp_path: Path
) -> None:
    path = tmp_path / "tiny.gguf"
    path.write_bytes(gguf_bytes(tiny_llama()))
    url = bare_daemon.url + "/api/v1/models/import-gguf"
    for field, value in (("dtype", "fp64"), ("keep_quantized", "yes"), ("dtype", 16)):
        answer = loopback.post(url, json={"path": str(path), field: value}, timeout=120)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == field and repr(value) in error["message"]
    assert bare_daemon.get("/api/v1/models").json() == []
    forms = {"fp32": {"dtype": "fp32", "keep_quantized": False}, "default": {}}
    for name, options in forms.items():
        body = {"path": str(path), "name": f"tiny-{name}", **options}
        answer = loopback.post(url, json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        config = json.loads((Path(answer.json()["path"]) / "config.json").read_text())
        assert config["torch_dtype"] == ("float32" if name == "fp32" else "bfloat16")
