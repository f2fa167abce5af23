"""``kunlun-platform --require-signed`` and the integrity sweep, on a real daemon."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest
from tests import loopback
from tests.daemons import Daemon, Daemons, Profile, free_port, refused
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


# ---- weights derived from a signed package (issue 32, bug 8) ----

ASK = {"max_tokens": 16, "temperature": 0,
       "messages": [{"role": "user", "content": "What is the capital of France?"}]}  # fmt: skip


def audit_events(home: Path, event: str | None = None) -> list[dict]:
    lines = (home / "logs" / "audit.jsonl").read_text().splitlines()
    found = [json.loads(x) for x in lines]
    return [a for a in found if event is None or a["event"] == event]


def wait_audit(home: Path, event: str, count: int = 1, timeout: float = 60) -> list[dict]:
    """The audit log's ``event`` entries once there are ``count`` of them."""
    deadline = time.monotonic() + timeout
    while len(found := audit_events(home, event)) < count:
        if time.monotonic() > deadline:
            pytest.fail(f"{count} {event!r} audit events not within {timeout}s: {found}")
        time.sleep(0.2)
    return found


def cache_key(daemon: Daemon, job: str) -> str:
    """The plan-cache key of ``job``'s (first) replica, from its log."""
    logs = daemon.cli("workload", "logs", job).stdout
    return logs.split("plan_cache: ", 1)[1].split("(key ", 1)[1].split(")", 1)[0]


def overwrite(path: Path, offset: int, data: bytes) -> None:
    """What an intruder (or a bad disk) does to a sealed (read-only) file."""
    os.chmod(path, 0o600)
    with path.open("r+b") as handle:
        handle.seek(offset)
        handle.write(data)


def answer(daemon: Daemon, model: str) -> str:
    reply = loopback.post(daemon.url + "/v1/chat/completions", timeout=300,
                       json={"model": model, **ASK})  # fmt: skip
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["message"]["content"])


def test_tampered_converted_weights_are_not_served_after_a_restart(
    pack_tiny: PackFn, keys: Path, tmp_path: Path
) -> None:
    """The tiny float32 package served as bf16 runs from weights converted into the plan
    cache: sealed by the daemon when made; bytes overwritten while the daemon is down are
    found at the restart, discarded and converted again from the signed package: the greedy
    answer is the one the intact weights gave, the audit log names the file."""
    home = installed_home(tmp_path, pack_tiny(dtype="fp32"), keys)
    spec = "model: tiny\ndtype: bf16\nmax_num_seqs: 4\nmax_model_len: 256\nkv_cache_memory_mb: 8\n"
    # stopped and started again on its home on purpose (serve() would prune the package)
    daemon = Daemon(home, free_port())
    try:
        daemon.start("--require-signed", wait_ready=False)
        job = daemon.submit(spec)
        wait_state(daemon, job, "RUNNING")
        intact = answer(daemon, "tiny")
        key = cache_key(daemon, job)
        assert "conversion: cast" in daemon.cli("workload", "logs", job).stdout
        sealed = wait_audit(home, "sealed")[0]
        assert (sealed["kind"], sealed["name"], sealed["key"]) == ("conversion", "tiny", key)
        seal = home / "integrity" / "conversions" / f"{key}.json"
        assert stat.S_IMODE(seal.stat().st_mode) == 0o600
        weights = home / "plan-cache" / key / "weights" / "model.safetensors"
        assert stat.S_IMODE(weights.stat().st_mode) == 0o400
        assert json.loads(seal.read_text())["files"]["weights/model.safetensors"].startswith(
            "sha256:"
        )
        daemon.stop()
        size = weights.stat().st_size
        overwrite(weights, size // 2, b"\x7f" * (size // 4))  # a quarter of the weights

        daemon.start("--require-signed", wait_ready=False)  # the workload resumes
        wait_state(daemon, job, "RUNNING")
        assert answer(daemon, "tiny") == intact
        named = f"plan-cache/{key}/weights/model.safetensors"
        logs = daemon.cli("workload", "logs", job).stdout
        assert f"tampered: {named}: content differs from its SHA-256 when sealed" in logs, logs
        assert "discarded, converting it again from the signed package" in logs
        assert logs.count("conversion: cast") == 2, logs
        tampered = wait_audit(home, "tampered")[0]
        assert (tampered["kind"], tampered["name"], tampered["key"]) == ("conversion", "tiny", key)
        assert tampered["problems"] == [f"{named}: content differs from its SHA-256 when sealed"]
        print(f"re-hash of the {size >> 10} KiB bf16 conversion at start: {tampered['seconds']} s")
        wait_audit(home, "sealed", 2)  # made again from the package, and sealed
        metrics = daemon.get("/metrics").text
        assert 'kunlun_integrity_ok{kind="conversion",name="tiny"} 1.0' in metrics
        assert 'kunlun_integrity_failures_total{kind="conversion",name="tiny"} 1.0' in metrics
    finally:
        daemon.stop()


def test_the_sweep_stops_a_workload_whose_converted_weights_change(
    pack_tiny: PackFn, keys: Path, tmp_path: Path, daemons: Daemons
) -> None:
    """The tiny package served as bf16 and as w8a16 (two conversions, both sealed); bytes
    of the w8a16 one overwritten while it runs: the next sweep (every second here) stops
    that workload, not the other, and ``/metrics`` says so; submitted again, it is converted
    again from the signed package."""
    home = installed_home(tmp_path, pack_tiny(dtype="fp32"), keys)
    spec = "model: tiny\nname: {}\n{}\nmax_num_seqs: 4\nmax_model_len: 256\nkv_cache_memory_mb: 8\n"
    profile = Profile("conversions", args=("--require-signed", "--integrity-interval", "1"))
    with daemons.serve(profile, home) as daemon:
        bf16 = daemon.submit(spec.format("tiny-bf16", "dtype: bf16"), name="bf16")
        w8 = daemon.submit(spec.format("tiny-w8", "quantization: w8a16"), name="w8")
        wait_state(daemon, bf16, "RUNNING")
        wait_state(daemon, w8, "RUNNING")
        assert "conversion: cast" in daemon.cli("workload", "logs", bf16).stdout
        assert "conversion: quantized" in daemon.cli("workload", "logs", w8).stdout
        wait_audit(home, "sealed", 2)
        metrics = daemon.get("/metrics").text
        assert 'kunlun_integrity_ok{kind="conversion",name="tiny"} 1.0' in metrics
        key = cache_key(daemon, w8)
        weights = home / "plan-cache" / key / "weights" / "model.safetensors"
        overwrite(weights, weights.stat().st_size - 10, b"\x7f" * 4)
        changed = time.monotonic()
        described = wait_state(daemon, w8, "FAILED", timeout=30)
        print(f"the sweep stopped the workload {time.monotonic() - changed:.1f} s after the "
              "change (--integrity-interval 1)")  # fmt: skip
        named = f"plan-cache/{key}/weights/model.safetensors"
        assert "integrity check failed: conversion tiny version 1" in described["reason"]
        assert f"{named}: content differs from its SHA-256 when sealed" in described["reason"]
        assert daemon.describe(bf16)["state"] == "RUNNING"  # its own conversion is intact
        metrics = daemon.get("/metrics").text
        assert 'kunlun_integrity_ok{kind="conversion",name="tiny"} 0.0' in metrics
        assert 'kunlun_integrity_failures_total{kind="conversion",name="tiny"}' in metrics
        assert 'kunlun_integrity_ok{kind="package",name="tiny"} 1.0' in metrics

        again = daemon.submit(spec.format("tiny-w8", "quantization: w8a16"), name="w8-again")
        wait_state(daemon, again, "RUNNING")
        logs = daemon.cli("workload", "logs", again).stdout
        assert f"tampered: {named}: content differs" in logs and "conversion: quantized" in logs
        wait_audit(home, "sealed", 3)
        metrics = daemon.get("/metrics").text
        assert 'kunlun_integrity_ok{kind="conversion",name="tiny"} 1.0' in metrics
    failure = next(a for a in audit_events(home, "integrity_failure") if a["kind"] == "conversion")
    assert failure["name"] == "tiny" and failure["problems"][0].startswith(named)
    assert any(a["event"] == "stopped" and a["workload"] == w8 for a in audit_events(home))
    assert not any(a["event"] == "stopped" and a["workload"] == bf16 for a in audit_events(home))
    assert audit_events(home, "tampered")[0]["model"] == "tiny-w8"


def test_a_conversion_is_sealed_and_each_change_to_it_is_named(
    pack_tiny: PackFn, keys: Path, tmp_path: Path
) -> None:
    """:class:`ModelGuard` on an installed package and a real conversion, without a daemon:
    what a worker makes is checked against the SHA-256 it took as it wrote and sealed; a
    conversion without a seal is discarded; every kind of change is named (bytes, an added
    file, a link pointed elsewhere, the seal rewritten), by the sweep and after a restart."""
    from kunlun.engine.convert import prepare_weights
    from kunlun.offline.integrity import ModelGuard
    from kunlun.offline.registry import Registry
    from kunlun.offline.signing import TrustedKeys

    home = installed_home(tmp_path, pack_tiny(dtype="fp32"), keys)
    trusted = TrustedKeys.from_paths([home / "trusted-keys"])
    guard = ModelGuard(home, trusted, require_signed=True)
    model = Registry.load(home).active["tiny"].model_dir
    entry = home / "plan-cache" / "k1"
    entry.mkdir(parents=True)
    (entry / "plan.json").write_text("{}")  # the daemon's own files are not artifacts
    weights = entry / "weights"
    where = "plan-cache/k1/weights"

    # made by a worker, changed before the seal: found against the hashes taken as made
    assert guard.check_conversion("tiny", model, entry, "wl-1") is None
    prepare_weights(model, weights, "bf16")
    overwrite(weights / "model.safetensors", 100, b"\x7f" * 4)
    bad = guard.seal("wl-1")
    assert bad[0].problems == [f"{where}/model.safetensors: content differs from its SHA-256 "
                               "when made"] and bad[0].workloads == ["wl-1"]  # fmt: skip
    assert not weights.exists() and guard.status[("conversion", "tiny")] is False

    # made again and sealed: read-only, the seal private, reuse verified
    prepare_weights(model, weights, "bf16")
    assert guard.check_conversion("tiny", model, entry, "wl-2") is None  # sealed here: ours
    assert guard.status[("conversion", "tiny")] is True
    seal = home / "integrity" / "conversions" / "k1.json"
    assert stat.S_IMODE(seal.stat().st_mode) == 0o600
    assert stat.S_IMODE(weights.stat().st_mode) == 0o500
    files = json.loads(seal.read_text())["files"]
    assert files["weights/tokenizer.json"] == f"link:{model / 'tokenizer.json'}"
    line = guard.check_conversion("tiny", model, entry, "wl-3")
    assert line is not None and "matches its seal" in line
    assert guard.check_conversions({"wl-3"})[0].ok

    # an added file, a link pointed elsewhere, the seal rewritten: the sweep names each
    os.chmod(weights, 0o700)
    (weights / "extra.safetensors").write_bytes(b"\0" * 8)
    evil = tmp_path / "tokenizer.json"
    evil.write_text("{}")
    (weights / "tokenizer.json").unlink()
    (weights / "tokenizer.json").symlink_to(evil)
    forged = json.loads(seal.read_text())
    forged["files"]["weights/extra.safetensors"] = "sha256:" + "0" * 64
    seal.write_text(json.dumps(forged))
    found = guard.check_conversions({"wl-3"})[0]
    assert not found.ok and found.workloads == ["wl-3"]
    assert found.problems == [
        "integrity/conversions/k1.json: differs from the seal this daemon wrote",
        f"{where}/extra.safetensors: added after the conversion was sealed",
        f"{where}/tokenizer.json: now a link to {evil}, sealed as a link to "
        f"{model / 'tokenizer.json'}",
    ]
    assert guard.status[("conversion", "tiny")] is False

    # a restart (no memory) with the seal file gone: not trusted, discarded
    seal.unlink()
    restarted = ModelGuard(home, trusted, require_signed=True)
    line = restarted.check_conversion("tiny", model, entry, "wl-4")
    assert line is not None and "discarded (not sealed" in line and not weights.exists()
    assert audit_events(home, "discarded")[0]["path"] == "plan-cache/k1"

    # made for one workload, changed before its seal, found as another starts from it: the
    # first must stop (it may have loaded the changed bytes), the second converts again
    prepare_weights(model, weights, "bf16")
    overwrite(weights / "model.safetensors", 100, b"\x7f" * 4)
    line = restarted.check_conversion("tiny", model, entry, "wl-5")
    assert (
        line is not None and "model.safetensors: content differs from its SHA-256 when made" in line
    )
    assert [f.workloads for f in restarted.take_stops()] == [["wl-4"]] and not weights.exists()
    tampered = audit_events(home, "tampered")
    assert [t["key"] for t in tampered] == ["k1", "k1"] and tampered[0]["model"] is None
