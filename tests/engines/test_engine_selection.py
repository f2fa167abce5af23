"""Finding engines through the ``kunlun.engines`` entry points, choosing one for a workload,
and refusing what this slice cannot do (launching an external engine).

Package metadata is real: a distribution's ``entry_points.txt`` written into a folder on
``sys.path`` is what ``pip install`` of a vendor package leaves, and importlib.metadata reads
it the same way. "Installed" is real too: the probe looks for the module on ``sys.path``
without importing it, so an (empty) ``vllm`` package there is an installed vLLM to it.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tomllib
from pathlib import Path

import pytest
from pydantic import ValidationError
from tests.planner.conftest import ROOT, model, node

import kunlun
from kunlun.engines.adapter import find_binary
from kunlun.engines.registry import BUILTINS, LoadedEngines, choose_engine, load_engines
from kunlun.errors import ConfigError
from kunlun.node.agent import NodeAgent
from kunlun.serving.replica import ReplicaSet
from kunlun.state.sqlite import SQLiteStore
from kunlun.workload.manager import WorkloadManager
from kunlun.workload.placement import place
from kunlun.workload.spec import WorkloadSpec

QWEN = model("Qwen2-0.5B")
ACME = """
from kunlun.engines.adapter import Availability, EngineAdapter


class AcmeEngine(EngineAdapter):
    name = "acme"
    formats = ("hf",)
    device_types = ("ascend",)

    def installed(self, device_type=None):
        return Availability(True, "acme-serve 1.0")

    def command(self, plan, context):
        raise NotImplementedError
"""


def distribution(root: Path, name: str, entries: dict[str, str]) -> None:
    """A distribution ``name`` under ``root`` registering ``entries`` in kunlun.engines."""
    info = root / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entries.items())
    (info / "entry_points.txt").write_text(f"[kunlun.engines]\n{lines}")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder on sys.path holding this checkout's own engine entry points (the installed
    metadata may predate them) and what a test installs."""
    root = tmp_path / "site"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    distribution(
        root, "kunlun_engines_here", pyproject["project"]["entry-points"]["kunlun.engines"]
    )
    monkeypatch.syspath_prepend(str(root))
    return root


def test_the_built_ins_are_registered_through_the_entry_point_group(site: Path) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"]["kunlun.engines"] == BUILTINS
    loaded = load_engines()
    assert set(BUILTINS) <= set(loaded.engines)
    assert loaded.notes == [] and loaded.load_errors == {}
    assert {n: type(e).__name__ for n, e in loaded.engines.items() if n in BUILTINS} == {
        "kunlun": "KunlunEngine", "llama.cpp": "LlamaCppEngine",
        "vllm": "VllmEngine", "sglang": "SglangEngine",
    }  # fmt: skip


def test_a_vendor_package_adds_an_engine_and_a_broken_one_is_reported(site: Path) -> None:
    (site / "acme_engine.py").write_text(ACME)
    distribution(site, "acme_engine", {"acme": "acme_engine:AcmeEngine",
                                       "broken": "acme_engine:Missing"})  # fmt: skip
    loaded = load_engines()
    assert "acme" in loaded.engines and "broken" not in loaded.engines
    assert "cannot load engine 'broken' (acme_engine:Missing)" in loaded.load_errors["broken"]
    choice = choose_engine("acme", "ascend", "hf", loaded)
    assert choice.chosen == "acme"
    auto = dict(choose_engine("auto", "ascend", "hf", loaded).rejected)
    assert auto["acme"] == "could run it; auto prefers kunlun (set engine: acme)"
    assert auto["broken"] == loaded.load_errors["broken"]
    assert dict(choose_engine("auto", "nvidia", "hf", loaded).rejected)["acme"] == (
        "does not run on nvidia devices (runs on ascend)"
    )


def fake_install(site: Path, *modules: str) -> None:
    for name in modules:
        (site / name).mkdir()
        (site / name / "__init__.py").write_text("")
    importlib.invalidate_caches()


def test_auto_is_the_embedded_engine_and_says_why_not_the_others(site: Path) -> None:
    fake_install(site, "vllm", "sglang")
    loaded = load_engines()
    choice = choose_engine("auto", "ascend", "hf", loaded)
    assert choice.chosen == "kunlun"
    reasons = dict(choice.rejected)
    assert reasons["llama.cpp"] == "does not take hf models (takes gguf)"
    assert reasons["vllm"] == "not installed: python module vllm_ascend is not importable"
    if importlib.util.find_spec("torch_npu") is None:  # the Ascend plugin's torch extension
        assert reasons["sglang"] == "not installed: python module torch_npu is not importable"
    nvidia = dict(choose_engine("auto", "nvidia", "hf", loaded).rejected)
    assert nvidia["vllm"] == "could run it; auto prefers kunlun (set engine: vllm)"
    gguf = dict(choose_engine("auto", "cambricon", "gguf", loaded).rejected)
    assert gguf["llama.cpp"] == "does not run on cambricon devices (runs on cpu, nvidia, amd)"


def test_an_engine_says_its_installed_version() -> None:
    """The version a placement (and a known-good snapshot) records: llama-server's own words
    where it is installed (``make llama-server``), a Python engine's distribution version,
    None where the engine is not installed."""
    engines = load_engines().engines
    if find_binary("llama-server") is not None:
        said = engines["llama.cpp"].version()
        assert said is not None and said.startswith("version: ") and "build" in said, said
    for name in ("vllm", "sglang"):
        if importlib.util.find_spec(name) is None:
            assert engines[name].version() is None


def test_a_forced_engine_that_cannot_run_here_is_an_error_naming_why(site: Path) -> None:
    loaded = load_engines()
    with pytest.raises(ConfigError, match=r"engine llama.cpp cannot run this workload: does "
                                          r"not take hf models"):  # fmt: skip
        choose_engine("llama.cpp", "cpu", "hf", loaded)
    if importlib.util.find_spec("sglang") is None:
        with pytest.raises(ConfigError, match="not installed: python module sglang is not "):
            choose_engine("sglang", "nvidia", "hf", loaded)
    with pytest.raises(ConfigError, match="engine 'tgi' is not registered"):
        choose_engine("tgi", "nvidia", "hf", loaded)


def test_the_spec_engine_defaults_to_auto_and_embedded_is_kunlun() -> None:
    assert WorkloadSpec(model="m").engine == "auto"
    assert WorkloadSpec(model="m", engine="embedded").engine == "kunlun"
    # the names are the registry's (built-ins and entry points), not a list of the spec's
    with pytest.raises(ValidationError, match=r"engine must be auto or a registered engine "
                                              r"\(kunlun, llama.cpp, sglang, vllm\), got 'tgi'"):  # fmt: skip
        WorkloadSpec(model="m", engine="tgi")


def test_the_plan_carries_the_engine_chosen_and_the_reasons(site: Path) -> None:
    placement = place(WorkloadSpec(model="Qwen2-0.5B", device="nvidia:0"), node("mixed"), QWEN)
    assert placement.plans[0].engine == "kunlun" and placement.engine is not None
    out = placement.to_dict()["engine"]
    assert out["requested"] == "auto" and out["chosen"] == "kunlun"
    assert out["version"] == kunlun.__version__  # the embedded engine is this platform's
    assert {"engine": "llama.cpp", "reason": "does not take hf models (takes gguf)"} in (
        out["rejected"]
    )


def manager(tmp_path: Path) -> WorkloadManager:
    store = SQLiteStore(tmp_path / "state.db")
    agent = NodeAgent(tmp_path, ReplicaSet(), lambda *event: None)
    return WorkloadManager(store, agent, ReplicaSet(), lambda: node("mixed"))


def test_submit_launches_an_external_engine_through_the_node_agent(
    site: Path, tmp_path: Path
) -> None:
    fake_install(site, "vllm")
    workloads = manager(tmp_path)
    spec = WorkloadSpec(model="Qwen2-0.5B", device="nvidia:0", engine="vllm")
    placement = workloads.plan(spec)
    assert placement.plans[0].engine == "vllm"  # planned: vLLM is installed and takes it
    record = workloads.submit(spec)
    (worker,) = workloads.agent.workers.values()
    command = worker.command
    assert command is not None and command.engine == "vllm"
    assert command.argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert command.argv[command.argv.index("--served-model-name") + 1] == "Qwen2-0.5B"
    assert worker.env["CUDA_VISIBLE_DEVICES"] == "0"  # the plan's visibility, from its plugin
    assert worker.replica.engine == "vllm" and worker.replica.stats_path == "/health"
    assert worker.log_path == workloads.agent.log_path(record.workload_id)
    workloads.stop(record.workload_id)
    assert workloads.agent.workers == {}
    dry = workloads.submit(WorkloadSpec(model="Qwen2-0.5B", device="nvidia:0"), dry_run=True)
    assert dry.placement["engine"]["chosen"] == "kunlun"


def test_loaded_engines_without_the_embedded_one_cannot_choose_auto() -> None:
    with pytest.raises(ConfigError, match="engine 'kunlun' is not registered"):
        choose_engine("kunlun", "cpu", "hf", LoadedEngines({}))
    with pytest.raises(ConfigError, match="engine auto: kunlun is not registered"):
        choose_engine("auto", "cpu", "hf", LoadedEngines({}))


def test_plan_explain_shows_the_engine_chosen_and_every_engine_rejected(tmp_path: Path) -> None:
    from tests.planner.test_plan_cli import cli, mixed

    proc = cli("--model", "Qwen2-0.5B", *mixed(), "--device", "nvidia:0", "--explain",
               home=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (
        "engine: kunlun (auto: kunlun, the embedded engine, runs this model on nvidia; no "
        "two engines measured here (kunlun-cli bench --record))"
    ) in proc.stdout
    assert "Engines not chosen" in proc.stdout and "llama.cpp" in proc.stdout
    proc = cli("--model", "Qwen2-0.5B", *mixed(), "--device", "nvidia:0", "--json",
               home=tmp_path)  # fmt: skip
    engine = json.loads(proc.stdout)["engine"]
    assert engine["chosen"] == "kunlun"
    assert {r["engine"] for r in engine["rejected"]} >= {"llama.cpp", "vllm", "sglang"}
    proc = cli("--model", "Qwen2-0.5B", *mixed(), "--device", "nvidia:0", "--engine",
               "llama.cpp", home=tmp_path)  # fmt: skip
    assert proc.returncode == 2
    assert "engine llama.cpp cannot run this workload: does not take hf models" in (
        proc.stdout + proc.stderr
    )
