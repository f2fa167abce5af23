"""``kunlun-platform --require-signed`` and the integrity sweep, on a real daemon."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest
from tests.daemons import Daemon, Daemons, Profile, refused
from tests.offline.conftest import PackFn, run
from tests.planner.conftest import NODES


def installed_home(tmp_path: Path, package: Path, keys: Path) -> Path:
    home = tmp_path / "home"
    run("kunlun-installer", "install", "--home", str(home), "--package", str(package),
        "--public-key", str(keys / "kunlun-signing.pub"), home=home)  # fmt: skip
    return home


def test_require_signed_needs_keys_and_a_signed_device_config(
    keys: Path, other_keys: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    done = refused(home, "--require-signed")
    assert done.returncode == 2 and "--require-signed needs trusted keys" in done.stderr
    config = tmp_path / "device-plugin-config.yaml"
    config.write_bytes((NODES / "mixed" / "device-plugin-config.yaml").read_bytes())
    trust = ["--require-signed", "--trusted-keys", str(keys), "--config", str(config)]
    done = refused(home, *trust)
    assert done.returncode == 3, done.stdout + done.stderr
    assert f"{config}: no detached signature device-plugin-config.yaml.sig" in done.stderr
    run("kunlun-cli", "keys", "sign", str(config), "--key", str(other_keys / "kunlun-signing.key"),
        home=home)  # fmt: skip
    done = refused(home, *trust)
    assert done.returncode == 3 and "does not verify with any trusted key" in done.stderr
    run("kunlun-cli", "keys", "sign", str(config), "--key", str(keys / "kunlun-signing.key"),
        home=home)  # fmt: skip
    config.write_bytes(config.read_bytes() + b"\n# edited after signing\n")
    done = refused(home, *trust)
    assert done.returncode == 3 and "does not verify with any trusted key" in done.stderr


def test_require_signed_serves_a_package_and_refuses_a_plain_directory(
    pack_tiny: PackFn, keys: Path, tiny_llama: Path, tmp_path: Path, daemons: Daemons
) -> None:
    home = installed_home(tmp_path, pack_tiny(), keys)
    config = tmp_path / "device-plugin-config.yaml"
    config.write_text("devices: []\n")
    run("kunlun-cli", "keys", "sign", str(config), "--key", str(keys / "kunlun-signing.key"),
        home=home)  # fmt: skip
    signed_only = Profile("signed-only", args=("--require-signed", "--config", str(config)))
    with daemons.serve(signed_only, home) as daemon:
        plain = daemon.cli("workload", "submit", "--model", str(tiny_llama), "--name", "plain")
        assert plain.returncode != 0 and "-> 403" in plain.stderr, plain.stdout + plain.stderr
        assert "is not an installed signed package" in plain.stderr
        good = daemon.cli("workload", "submit", "--model", "tiny", "--json")
        assert good.returncode == 0, good.stderr
        job = json.loads(good.stdout)["workload_id"]
        wait_state(daemon, job, "RUNNING")
        model = home / "packages" / "tiny" / "1" / "model"  # the daemon left them read-only
        assert stat.S_IMODE(model.stat().st_mode) == 0o555
        assert stat.S_IMODE((model / "config.json").stat().st_mode) == 0o444
        logs = daemon.cli("workload", "logs", job).stdout
        assert "plan_cache: hit" in logs and "conversion: none" in logs, logs
    audit = [json.loads(x) for x in (home / "logs" / "audit.jsonl").read_text().splitlines()]
    kinds = [(a["event"], a.get("kind")) for a in audit]
    assert ("verified", "device_config") in kinds and ("verified", "package") in kinds
    assert any(a["event"] == "refused" and tiny_llama.name in a["path"] for a in audit)


def wait_state(daemon: Daemon, job: str, state: str, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        described = daemon.describe(job)
        if described["state"] == state:
            return described
        if time.monotonic() > deadline:
            pytest.fail(f"{job} is {described['state']}, not {state}:\n{daemon.log()}")
        time.sleep(0.3)


def test_a_file_changed_under_a_served_package_stops_it_until_repaired(
    pack_tiny: PackFn, keys: Path, tmp_path: Path, daemons: Daemons
) -> None:
    home = installed_home(tmp_path, pack_tiny(), keys)
    with daemons.serve(Profile("integrity", args=("--integrity-interval", "1")), home) as daemon:
        job = json.loads(daemon.cli("workload", "submit", "--model", "tiny", "--json").stdout)[
            "workload_id"
        ]
        wait_state(daemon, job, "RUNNING")
        metrics = daemon.get("/metrics").text
        assert 'kunlun_integrity_ok{kind="package",name="tiny"} 1.0' in metrics
        weights = home / "packages" / "tiny" / "1" / "model" / "model.safetensors"
        os.chmod(weights, 0o644)
        with weights.open("r+b") as handle:  # what an intruder (or a bad disk) does
            handle.seek(weights.stat().st_size - 10)
            handle.write(b"\x7f" * 4)
        described = wait_state(daemon, job, "FAILED", timeout=30)
        assert "integrity check failed: package tiny version 1" in described["reason"]
        assert "model/model.safetensors: content differs from its SHA-256" in described["reason"]
        metrics = daemon.get("/metrics").text
        assert 'kunlun_integrity_ok{kind="package",name="tiny"} 0.0' in metrics
        assert 'kunlun_integrity_failures_total{kind="package",name="tiny"}' in metrics
        refused = daemon.cli("workload", "submit", "--model", "tiny", "--name", "again")
        assert refused.returncode == 0  # recorded, then refused at start with the reason
        again = json.loads(daemon.cli("workload", "list", "--json").stdout)
        retry = next(w for w in again if w["name"] == "again")
        described = wait_state(daemon, retry["workload_id"], "FAILED", timeout=30)
        assert "fails its integrity check" in described["reason"]
        run("kunlun-installer", "--repair", "--home", str(home), home=home)
        fixed = daemon.cli("workload", "submit", "--model", "tiny", "--name", "fixed", "--json")
        wait_state(daemon, json.loads(fixed.stdout)["workload_id"], "RUNNING")
    audit = [json.loads(x) for x in (home / "logs" / "audit.jsonl").read_text().splitlines()]
    failure = next(a for a in audit if a["event"] == "integrity_failure")
    assert failure["name"] == "tiny" and failure["version"] == 1
    assert any(a["event"] == "stopped" and a["workload"] == job for a in audit)
