"""``kunlun-cli keys``, ``model pack | verify | inspect``: what a package holds, that it verifies,
that it is reproducible, and that tampering is caught."""

from __future__ import annotations

import hashlib
import json
import re
import tarfile
from pathlib import Path

from tests.offline.conftest import PackFn, run
from tests.planner.conftest import NODES

from kunlun.offline.manifest import parse


def members(package: Path) -> dict[str, bytes]:
    with tarfile.open(package) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]


def test_keys_generate_writes_a_private_key_only_its_owner_reads(keys: Path) -> None:
    assert (keys / "kunlun-signing.key").stat().st_mode & 0o777 == 0o600
    assert b"BEGIN PUBLIC KEY" in (keys / "kunlun-signing.pub").read_bytes()
    again = run("kunlun-cli", "keys", "generate", "--out", str(keys), home=keys, check=False)
    assert again.returncode == 2 and "already exists" in again.stderr


def test_a_package_holds_the_weights_plan_profile_engine_and_a_signed_manifest(
    pack_tiny: PackFn, keys: Path, tiny_llama: Path
) -> None:
    package = pack_tiny()
    files = members(package)
    names = list(files)
    assert names[:2] == ["manifest.json", "manifest.sig"]  # the signature is read first
    assert names[2:] == sorted(names[2:])
    for want in ("model/config.json", "model/model.safetensors", "model/tokenizer.json",
                 "model/tokenizer_config.json", "plan/plan.json", "plan/engine.json",
                 "plan/device-profile.json"):  # fmt: skip
        assert want in files, names
    manifest = parse(files["manifest.json"])
    assert manifest.name == "tiny" and manifest.version == 1
    assert manifest.created == "2026-09-21T14:13:20Z"
    listed = {f.path: f for f in manifest.files}
    assert set(listed) == set(names[2:])
    for path, entry in listed.items():
        assert entry.size == len(files[path])
        assert entry.sha256 == hashlib.sha256(files[path]).hexdigest()
    model = manifest.extra["model"]
    assert model["target_device_types"] == ["cpu"] and model["target_devices"] == ["cpu:0"]
    assert model["min_memory_mb"] > 0 and "engine kunlun" in model["plan_summary"]
    plan = json.loads(files["plan/plan.json"])
    assert plan["devices"] == ["cpu:0"] and plan["model_path"] is None
    engine = json.loads(files["plan/engine.json"])
    assert engine["model_dir"] == "model" and engine["dtype"] == plan["dtype"]
    profile = json.loads(files["plan/device-profile.json"])
    assert profile["snapshot"][0]["device"] == "cpu:0"
    # the weights are what the plan runs: already in its dtype, nothing to convert at start
    header = files["model/model.safetensors"]
    size = int.from_bytes(header[:8], "little")
    dtypes = {
        v["dtype"] for k, v in json.loads(header[8 : 8 + size]).items() if k != "__metadata__"
    }
    assert dtypes == {{"bf16": "BF16", "fp16": "F16", "fp32": "F32"}[plan["dtype"]]}


def test_verify_checks_signature_and_hashes_and_prints_throughput(
    pack_tiny: PackFn, keys: Path, tmp_path: Path
) -> None:
    done = run("kunlun-cli", "model", "verify", "--package", str(pack_tiny()), "--public-key",
               str(keys / "kunlun-signing.pub"), home=tmp_path)  # fmt: skip
    assert re.search(r"OK tiny version 1: signature by SHA256:[0-9a-f]{64}", done.stdout)
    assert re.search(r"verified in [0-9.]+ s \([0-9.]+ GB/s\)", done.stdout), done.stdout


def test_verify_refuses_a_flipped_bit_naming_the_file(
    pack_tiny: PackFn, keys: Path, tmp_path: Path
) -> None:
    package = pack_tiny()
    with tarfile.open(package) as tar:
        offset = tar.getmember("model/tokenizer.json").offset_data
    bad = tmp_path / "bad.kunlunpkg"
    data = bytearray(package.read_bytes())
    data[offset + 100] ^= 0x01
    bad.write_bytes(bytes(data))
    done = run("kunlun-cli", "model", "verify", "--package", str(bad), "--public-key",
               str(keys / "kunlun-signing.pub"), home=tmp_path, check=False)  # fmt: skip
    assert done.returncode == 3, done.stdout + done.stderr
    assert "'model/tokenizer.json' does not match its SHA-256" in done.stderr


def test_inspect_shows_devices_quantization_memory_plan_and_signer(
    pack_tiny: PackFn, keys: Path, tmp_path: Path
) -> None:
    package = pack_tiny(version=3, quantize="w8a16")
    done = run("kunlun-cli", "model", "inspect", str(package), "--json", "--public-key",
               str(keys / "kunlun-signing.pub"), home=tmp_path)  # fmt: skip
    info = json.loads(done.stdout)
    assert info["name"] == "tiny" and info["version"] == 3
    assert info["target_device_types"] == ["cpu"] and info["quantization"] == "w8a16"
    assert info["min_memory_mb"] > 0 and "quantization w8a16" in info["plan_summary"]
    pub = run("kunlun-cli", "keys", "generate", "--out", str(tmp_path / "k2"), home=tmp_path)
    assert info["signer"].startswith("SHA256:") and info["signature"] == "verified"
    assert info["signer"] not in pub.stdout  # a different key has a different fingerprint
    config = json.loads(members(package)["model/config.json"])
    assert config["quantization_config"]["scheme"] == "w8a16"  # packed already quantized


def test_packing_twice_gives_the_same_bytes(pack_tiny: PackFn) -> None:
    first = pack_tiny(version=5, created=1_800_000_000)
    second = pack_tiny(version=5, created=1_800_000_000, name="tiny-again")
    a, b = members(first), members(second)
    assert {k: v for k, v in a.items() if k.startswith("model/")} == {
        k: v for k, v in b.items() if k.startswith("model/")
    }
    later = pack_tiny(version=5, created=1_800_000_100)
    hashes = lambda p: {f.path: f.sha256 for f in parse(members(p)["manifest.json"]).files}  # noqa: E731
    assert hashes(first) == hashes(later)  # another time: the same file hashes
    # same model, version and time: the very same package (Ed25519 signs deterministically)
    third = pack_tiny(version=5, created=1_800_000_000, name="tiny", quantize="none")
    assert (
        hashlib.sha256(first.read_bytes()).digest() == hashlib.sha256(third.read_bytes()).digest()
    )


def test_pack_refuses_a_model_without_weights(keys: Path, tmp_path: Path) -> None:
    done = run("kunlun-cli", "model", "pack", "--model", "Qwen2-0.5B", "--key",
               str(keys / "kunlun-signing.key"), "-o", str(tmp_path / "x.kunlunpkg"),
               home=tmp_path, check=False)  # fmt: skip
    assert done.returncode != 0 and "has no weights (*.safetensors) to pack" in done.stderr
    assert not (tmp_path / "x.kunlunpkg").exists()


def test_pack_for_a_recorded_ascend_node_carries_its_declaration(pack_tiny: PackFn) -> None:
    config = NODES / "mixed" / "device-plugin-config.yaml"
    package = pack_tiny(version=7, name="tiny-npu", target_device="ascend:0",
                        replay=str(NODES / "mixed"), config=str(config))  # fmt: skip
    files = members(package)
    model = parse(files["manifest.json"]).extra["model"]
    assert model["target_device_types"] == ["ascend"] and model["target_devices"] == ["ascend:0"]
    assert model["declaration"] == "plan/device-plugin-config.yaml"
    assert files["plan/device-plugin-config.yaml"] == config.read_bytes()
    assert json.loads(files["plan/engine.json"])["device_type"] == "ascend"


def test_keys_sign_and_verify_a_detached_signature(
    keys: Path, other_keys: Path, tmp_path: Path
) -> None:
    digest = tmp_path / "kunlun-offline-image.digest"
    digest.write_text("kunlun-platform-offline:latest sha256:" + "ab" * 32 + "\n")
    run("kunlun-cli", "keys", "sign", str(digest), "--key", str(keys / "kunlun-signing.key"),
        home=tmp_path)  # fmt: skip
    ok = run("kunlun-cli", "keys", "verify", str(digest), "--public-key",
             str(keys / "kunlun-signing.pub"), home=tmp_path)  # fmt: skip
    assert re.search(r"OK .*: signed by SHA256:[0-9a-f]{64}", ok.stdout)
    other = run("kunlun-cli", "keys", "verify", str(digest), "--public-key",
                str(other_keys / "kunlun-signing.pub"), home=tmp_path, check=False)  # fmt: skip
    assert other.returncode == 3 and "does not verify with any trusted key" in other.stderr
    digest.write_text(digest.read_text().replace("ab", "cd", 1))
    edited = run("kunlun-cli", "keys", "verify", str(digest), "--public-key",
                 str(keys / "kunlun-signing.pub"), home=tmp_path, check=False)  # fmt: skip
    assert edited.returncode == 3
