"""``kunlun-cli acceptance``: layer 1 of a recorded 8-device Ascend node and of this machine's
daemon, layer 2 of the tiny model on this machine's CPU; each report signed, verified, and
refused once a byte of it changes. Layers 3 to 5 are refused as not built yet."""

from __future__ import annotations

import json
from pathlib import Path

from tests.daemons import Daemon, Daemons, Profile

ROOT = Path(__file__).resolve().parents[2]
ASCEND = ROOT / "examples" / "nodes" / "ascend-910a-8x"


def run_cli(daemon: Daemon, *args: str, remote: bool = True) -> tuple[int, str]:
    proc = daemon.cli("acceptance", *args, remote=remote, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def test_layer_reports_are_signed_and_a_changed_byte_is_refused(
    daemons: Daemons, tiny_model: Path, tmp_path: Path
) -> None:
    with daemons.serve(Profile("acceptance-home")) as daemon:
        keys = tmp_path / "keys"
        made = daemon.cli("keys", "generate", "--out", str(keys), remote=False)
        assert made.returncode == 0, made.stderr
        key, public = keys / "kunlun-signing.key", keys / "kunlun-signing.pub"

        # layer 1 of a recorded node: two of its eight NPUs are Degraded, said by name
        code, said = run_cli(daemon, "--layer", "1", "--replay", str(ASCEND), "--config",
                             str(ASCEND / "device-plugin-config.yaml"), "--out",
                             str(tmp_path / "ascend"), "--sign", str(key), remote=False)  # fmt: skip
        assert code == 1, said
        report = tmp_path / "ascend" / "acceptance-layer1.json"
        doc = json.loads(report.read_text())
        ready, memory, topology = doc["checkpoints"]
        assert ready["status"] == "FAIL" and ready["figure"] == "6 of 8 Ready"
        assert "ascend:3 Degraded" in ready["detail"] and len(ready["data"]["devices"]) == 8
        assert memory["status"] == "PASS" and memory["figure"] == "32768 MiB"
        assert topology["status"] == "PASS" and topology["figure"] == "8x8"
        assert (tmp_path / "ascend" / "acceptance-layer1.md").read_text().startswith("# Layer 1")

        verified = daemon.cli("acceptance", "verify", str(report), "--public-key", str(public),
                              remote=False)  # fmt: skip
        assert verified.returncode == 0 and "layer 1 (device visibility) FAIL" in verified.stdout
        report.write_text(report.read_text().replace('"FAIL"', '"PASS"', 1))  # a forged verdict
        forged = daemon.cli("acceptance", "verify", str(report), "--public-key", str(public),
                            remote=False)  # fmt: skip
        assert forged.returncode != 0 and "signature" in forged.stderr.lower(), forged.stderr

        # layers 1 and 2 of this machine, through the daemon
        code, said = run_cli(daemon, "--layer", "1", "--out", str(tmp_path / "here"))
        assert code == 0, said
        code, said = run_cli(daemon, "--layer", "2", "--model", str(tiny_model), "--ttft-ms",
                             "30000", "--out", str(tmp_path / "here"), "--sign", str(key))  # fmt: skip
        assert code == 0, said
        print(said)
        second = tmp_path / "here" / "acceptance-layer2.json"
        doc = json.loads(second.read_text())
        compiled, ttft, peak = doc["checkpoints"]
        assert doc["subject"]["device"] == "cpu:0" and compiled["status"] == "PASS", compiled
        assert ttft["status"] == "PASS" and ttft["data"]["ttft_ms"] > 0, ttft
        assert peak["status"] in ("PASS", "NOT RUN") and peak["detail"], peak
        assert daemon.cli("acceptance", "verify", str(second), "--public-key",
                          str(public)).returncode == 0  # fmt: skip
        rows = daemon.get("/api/v1/workloads").json()
        assert [r["state"] for r in rows] == ["STOPPED"]  # what it started is stopped

        code, said = run_cli(daemon, "--layer", "5")
        assert code == 2 and "layer 5 is not built yet" in said, said
