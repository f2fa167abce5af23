"""Everything under ``KUNLUN_HOME`` is the user's alone: directories 0700, files 0600.

A real daemon serves a request, takes an uploaded batch file and runs the batch (its output
and error files), starts a worker (its log, pid file, plan cache) and records a key; then
every directory and file under its home is checked, and under the home the CLI imported the
demo model into. What an older version left readable is tightened when the daemon starts.
The daemon serves the tiny model; its home's catalog (a copy of that home's) holds the demo's.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

from tests import loopback
from tests.daemons import TINY_SPEC, Daemons, Profile, wait_running

from kunlun.paths import DIR_MODE, FILE_MODE


def loose_paths(root: Path) -> list[str]:
    """Every directory not 0700 and file not 0600 under ``root`` (links are not followed:
    their own mode means nothing; what they point at is checked where it lives)."""
    loose = []
    for folder, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = Path(folder, name)
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                continue
            wanted = DIR_MODE if stat.S_ISDIR(info.st_mode) else FILE_MODE
            if stat.S_IMODE(info.st_mode) != wanted:
                loose.append(f"{path} {oct(stat.S_IMODE(info.st_mode))}")
    return loose


def test_everything_under_kunlun_home_is_private(
    models_home: Path,
    demo_model_dir: Path,
    tiny_model: Path,
    daemons: Daemons,
    tmp_path: Path,
) -> None:
    private = Profile("private-home", demo=True)
    home = daemons.home(private)
    old_dir = home / "logs"  # what an older version left behind, readable by everyone
    old_dir.mkdir(mode=0o755)
    (old_dir / "requests.jsonl").write_text("")
    old_dir.chmod(0o755)
    (old_dir / "requests.jsonl").chmod(0o644)
    (home / "state.db").chmod(0o644)
    with daemons.serve(private, home) as daemon:
        spec = tmp_path / "spec.yaml"  # outside the home: written by the test, not the daemon
        spec.write_text(TINY_SPEC.format(path=tiny_model, name="tiny"))
        submitted = daemon.cli("workload", "submit", "--file", str(spec), "--json")
        assert submitted.returncode == 0, submitted.stderr
        wait_running(daemon, [json.loads(submitted.stdout)["workload_id"]])
        answer = loopback.post(
            daemon.url + "/v1/completions",
            json={"model": "tiny", "prompt": "Hello", "max_tokens": 4},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        line = {
            "custom_id": "one",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": "Hi", "max_tokens": 2},
        }
        bad = {**line, "custom_id": "two", "body": {**line["body"], "temperature": 9}}
        uploaded = loopback.post(
            daemon.url + "/v1/files",
            data={"purpose": "batch"},
            files={"file": ("in.jsonl", f"{json.dumps(line)}\n{json.dumps(bad)}\n")},
            timeout=60,
        )
        assert uploaded.status_code == 200, uploaded.text
        batch = loopback.post(
            daemon.url + "/v1/batches",
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": "/v1/completions",
                "completion_window": "24h",
            },
            timeout=60,
        ).json()
        deadline = time.monotonic() + 300
        while batch["status"] not in ("completed", "failed"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.2)
            batch = daemon.get(f"/v1/batches/{batch['id']}").json()
        assert batch["status"] == "completed" and batch["error_file_id"], batch
        key = daemon.cli("apikey", "create", "ops", "--json")
        assert key.returncode == 0, key.stderr
        deadline = time.monotonic() + 60  # the request log is written within 0.5 s
        log = home / "logs" / "requests.jsonl"
        while log.stat().st_size == 0:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        made = {p.relative_to(home).parts[0] for p in home.rglob("*")}
        assert {"state.db", "files", "logs", "run", "plan-cache"} <= made, made
        assert loose_paths(home) == []
        assert stat.S_IMODE(home.stat().st_mode) == DIR_MODE
        assert daemon.stop() == 0
    assert loose_paths(home) == []
    assert loose_paths(models_home) == []  # the home the CLI registered the demo model in
    assert loose_paths(demo_model_dir) == []  # the demo model's files, imported once per machine
