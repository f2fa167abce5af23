"""``kunlun-cli adapt`` against a real daemon, on the tiny model (the mechanics: plan, start,
smoke, battery rows, bench, gates, the pool's verdict, teardown; a GGUF file imported first). Its quality gates on the demo model with two
engines are a documented command (docs/day-one.md): a minute and more of scoring that the
suite's validate tests already check row by row.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from tests.daemons import Daemon, Daemons, Profile
from tests.engine.gguf_bytes import MERGES, TOKENS
from tests.engine.gguf_files import hf_tensors, write_gguf


def adapt(daemon: Daemon, out: Path, *args: str) -> tuple[int, dict | None, str]:
    proc = daemon.cli("adapt", *args, "--out", str(out), "--requests", "2",
                      "--output-len", "4", "--snapshots", str(out.parent / "snapshots"),
                      timeout=600)  # fmt: skip
    doc = json.loads((out / "adapt.json").read_text()) if (out / "adapt.json").exists() else None
    return proc.returncode, doc, proc.stdout + proc.stderr


def byte_vocabulary_gguf(path: Path, model_dir: Path) -> Path:
    """The tiny model as a GGUF file whose vocabulary is the byte-level one of the GGUF tests
    and plain words up to the model's 2,048 rows (every token it samples is text)."""
    config, tensors = hf_tensors(model_dir, "llama")
    words = [f"w{i}" for i in range(config["vocab_size"] - len(TOKENS))]
    vocabulary = SimpleNamespace(metadata={
        "tokenizer.ggml.tokens": [*TOKENS, *words], "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.token_type": [1] * config["vocab_size"], "tokenizer.ggml.pre": "smollm"})  # fmt: skip
    return write_gguf(path, "llama", config, tensors, vocab_source=vocabulary)


@dataclass
class FirstDaemon:
    """A daemon after its first ``adapt`` (every engine), while it still runs."""

    daemon: Daemon
    out: Path
    code: int
    doc: dict | None
    said: str
    workloads: list[dict]
    """The daemon's workloads right after that run."""


@pytest.fixture(scope="module")
def first(request: pytest.FixtureRequest, tiny_model: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[FirstDaemon]:  # fmt: skip
    """One daemon and its first ``adapt`` run, which the tests below read and go on from (a
    second run held to the first's snapshot, that snapshot restored on a fresh daemon)."""
    out = tmp_path_factory.mktemp("adapt")
    with Daemons(request).serve(Profile("adapt-home")) as daemon:
        code, doc, said = adapt(daemon, out / "a", "--model", str(tiny_model),
                                "--engines", "kunlun,vllm", "--only", "api.models")  # fmt: skip
        workloads = daemon.get("/api/v1/workloads").json()
        yield FirstDaemon(daemon, out, code, doc, said, workloads)


def test_adapt_checks_every_engine_and_leaves_the_daemon_as_it_was(
    first: FirstDaemon, tiny_model: Path
) -> None:
    code, doc, said = first.code, first.doc, first.said
    # vllm cannot run here: its plan gate fails, and the pool is adapted with kunlun
    assert code == 0, said
    assert doc is not None
    assert doc["pools"]["cpu"]["status"] == "PASS" and doc["pools"]["cpu"]["engine"] == "kunlun"
    assert "not chosen: vllm: plan refused" in doc["pools"]["cpu"]["why"], doc["pools"]
    assert "pool cpu: adapted with kunlun: " in said
    by_column = {c["column"]: c for c in doc["columns"]}
    assert list(by_column) == ["cpu/kunlun", "cpu/vllm"]
    ours = by_column["cpu/kunlun"]["verdicts"]
    for gate in ("plan", "start", "smoke", "battery", "throughput", "failures"):
        assert ours[gate]["status"] == "PASS", (gate, ours[gate])
    # (rows whose answers hold no text: the tiny random model's text is garbage, which
    # the battery's garbage detector rightly fails)
    assert ours["battery"]["figure"] == "1 PASS, 0 FAIL, 2 SKIP", ours["battery"]
    assert "quality.garbage: no answers to judge" in ours["battery"]["why"]
    assert ours["numerics"]["status"] == ours["accuracy"]["status"] == "NOT RUN"
    assert "--only" in ours["accuracy"]["why"]
    assert by_column["cpu/kunlun"]["tokens_per_s"] > 0
    vllm = by_column["cpu/vllm"]["verdicts"]
    assert vllm["plan"]["status"] == "FAIL" and "vllm" in vllm["plan"]["why"], vllm["plan"]
    assert vllm["start"]["status"] == "NOT RUN"
    assert "FAIL plan on cpu/vllm: " in said and "Adaptation" in said
    report = json.loads((first.out / "a" / "validation.json").read_text())
    assert [c["name"] for c in report["columns"]] == ["cpu/kunlun"]
    # what it started is stopped again
    assert [(w["name"], w["state"]) for w in first.workloads] == [
        (by_column["cpu/kunlun"]["name"], "STOPPED")]  # fmt: skip
    assert ours["regression"]["status"] == "NOT RUN"  # no known-good snapshot yet
    (snapshot,) = doc["snapshots"]  # the kunlun column passed every gate it ran: known-good
    saved = json.loads(Path(snapshot).read_text())
    assert saved["spec"]["model"] == str(tiny_model) and saved["plan"]["devices"] == ["cpu:0"]
    assert saved["devices"][0]["id"] == "cpu:0" and saved["kunlun_version"]
    assert saved["engine_version"] == saved["kunlun_version"]  # the embedded engine's
    assert len(saved["greedy"]) == 3 and saved["model_fingerprint"]
    refused = first.daemon.cli("adapt", "--model", str(tiny_model), "--pools", "ascend",
                               "--out", str(first.out / "b"))  # fmt: skip
    assert refused.returncode == 2 and "no Ready ascend device; pools here: cpu" in (
        refused.stderr), refused.stderr  # fmt: skip


def test_adapt_again_is_held_to_the_known_good_snapshot_and_signed(
    first: FirstDaemon, tiny_model: Path, tmp_path: Path
) -> None:
    assert first.doc is not None, first.said
    (known_good,) = first.doc["snapshots"]
    daemon, keys = first.daemon, tmp_path / "keys"
    assert daemon.cli("keys", "generate", "--out", str(keys), remote=False).returncode == 0
    # (--throughput-share 0: the test checks what the gate compares, not this machine's
    # speed from one run to the next, which a loaded machine halves)
    code, again, said = adapt(daemon, first.out / "c", "--model", str(tiny_model),
                              "--only", "api.models", "--throughput-share", "0", "--sign",
                              str(keys / "kunlun-signing.key"))  # fmt: skip
    assert code == 0, said
    verified = daemon.cli("keys", "verify", str(first.out / "c" / "adapt.json"),
                          "--public-key", str(keys / "kunlun-signing.pub"), remote=False)  # fmt: skip
    assert verified.returncode == 0, verified.stderr
    assert again is not None
    regression = again["columns"][0]["verdicts"]["regression"]
    assert regression["status"] == "PASS" and Path(known_good).stem in regression["figure"]
    (second,) = again["snapshots"]
    snapshots = first.out / "snapshots"
    listed = daemon.cli("snapshot", "list", "--dir", str(snapshots), "--json", remote=False)
    assert [s["id"] for s in json.loads(listed.stdout)] == [Path(known_good).stem,
                                                            Path(second).stem]  # fmt: skip
    diff = daemon.cli("snapshot", "diff", Path(known_good).stem, Path(second).stem, "--dir",
                      str(snapshots), remote=False)  # fmt: skip
    assert diff.returncode == 0 and "figures.tokens_per_s: " in diff.stdout, diff.stdout


def test_a_snapshot_restored_on_a_fresh_daemon_serves_the_same_answers(
    first: FirstDaemon, daemons: Daemons, tiny_model: Path, tmp_path: Path
) -> None:
    assert first.doc is not None, first.said
    (snapshot,) = first.doc["snapshots"]
    saved = json.loads(Path(snapshot).read_text())
    with daemons.serve(Profile("adapt-restore-home")) as fresh:
        restored = fresh.cli("snapshot", "restore", Path(snapshot).stem, "--check", "--dir",
                             str(Path(snapshot).parent))  # fmt: skip
        assert restored.returncode == 0, restored.stdout + restored.stderr
        assert "greedy answers: 3 of 3 the same" in restored.stdout
        (row,) = fresh.get("/api/v1/workloads").json()
        assert row["state"] == "RUNNING" and row["name"] == saved["spec"]["name"]
        # a model given as a GGUF file (on the daemon's machine) is imported first
        (fresh.home / "models").mkdir(exist_ok=True)
        gguf = byte_vocabulary_gguf(fresh.home / "models" / "tiny-file.gguf", tiny_model)
        code, doc, said = adapt(fresh, tmp_path / "d", "--model", str(gguf), "--only",
                                "api.models", "--concurrency", "1")  # fmt: skip
        assert code == 0, said
        assert f"imported {gguf} as tiny-file" in said and doc is not None
        assert doc["model"] == "tiny-file" and doc["pools"]["cpu"]["engine"] == "kunlun"


def test_transformers_as_the_reference(daemons: Daemons, tiny_model: Path, tmp_path: Path) -> None:
    """``--reference transformers``: the tiny model run by Hugging Face transformers (float32,
    outside the platform) is the column the engine's numerics are held to."""
    with daemons.serve(Profile("adapt-hf-home")) as daemon:
        code, doc, said = adapt(daemon, tmp_path / "a", "--model", str(tiny_model), "--reference",
                                "transformers", "--only", "numerics", "--only", "api.models", "--only",
                                "functional.short_text", "--concurrency", "1")  # fmt: skip
        # (the tiny random model's greedy answers are noise, which quality.garbage rightly
        # fails: the pool is not adapted; what is checked here is the numerics)
        assert code == 1 and "quality.garbage" in said, said
        assert f"loading {tiny_model} with transformers (float32) as the reference" in said
        report = json.loads((tmp_path / "a" / "validation.json").read_text())
        assert [c["name"] for c in report["columns"]] == ["reference:transformers", "cpu/kunlun"]
        numerics = doc["columns"][0]["verdicts"]["numerics"] if doc else {}
        assert numerics["status"] == "PASS", numerics
        cells = report["cells"]["reference:transformers"]
        assert cells["numerics.prompt_logprobs"]["status"] == "PASS"  # against a second run
        assert cells["api.models"]["status"] == "PASS"
        # what transformers does not serve is said as such, never passed
        chat = cells["functional.short_text"]
        assert chat["status"] == "SKIP" and "/v1/chat/completions" in chat["detail"], chat
