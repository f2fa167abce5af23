"""Real ``kunlun-platform`` daemons on loopback, driven by the real CLI and clients.

The one place the suite starts daemons from. A daemon is described as data, a
:class:`Profile` (what it serves, its flags, keys, environment and files); :func:`serve`
starts one (keys made first, workloads submitted and ready) and stops it at the end, on a
home :func:`make_home` lays out. Tests get one through :func:`daemon_fixture` (the fixture
factory: one daemon per module, or per run for the shared daemons of ``tests/conftest.py``)
or, for a daemon of their own, the ``daemons`` fixture (:class:`Daemons`). :class:`Daemon`
wraps the process; :meth:`Daemon.start` again is how a test that stopped its daemon on
purpose restarts it.

Two models serve the tests (``tests/conftest.py``): the demo model (SmolLM2-135M-Instruct,
imported once per machine) where the quality of an answer is what is checked, and a tiny
random Llama with a built-in tokenizer (:func:`kunlun.engine.tiny.cached_tiny_model`) for
everything that checks plumbing: it loads in a moment and generates at hundreds of tokens/s.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests import loopback

BIN = Path(sys.executable).parent

ONE_THREAD = """\
devices:
  - device_type: cpu
    device_id: 0
    custom_attributes: {num_threads: 1}
"""
"""A declaration giving each CPU worker one thread. The suite runs two test files at once on
two cores, often with several workers each: workers with every core each would thrash
and their latencies say nothing."""

SPEC = """\
model: smollm2
max_num_seqs: 8
max_model_len: 1024
kv_cache_memory_mb: 96
"""
"""The demo model as workload ``smollm2``."""

TINY_SPEC = """\
model: {path}
name: {name}
max_num_seqs: 8
max_model_len: 1024
kv_cache_memory_mb: 16
"""
"""The tiny model (``path``) as workload ``name``."""


PORT_TAKEN = "is already in use by"
PORT_TAKEN_HINT = "pass --port)"
"""How the daemon refuses a port another process holds (``--port: port N on 127.0.0.1 is
already in use by ... (hint: stop that process or pass --port)``): a port :func:`free_port`
found free can be taken by another test's process before the daemon binds it, and the
starts here then try another."""


def lost_port(output: str) -> bool:
    """Whether a daemon's output ends with its refusal of a ``--port`` another process holds."""
    return output.rstrip().endswith(PORT_TAKEN_HINT) and PORT_TAKEN in output


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Daemon:
    home: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path = field(init=False)
    keys: dict[str, str] = field(default_factory=dict)
    """API keys made by :func:`serve`, by name."""
    job: str | None = None
    """The id of the first workload :func:`serve` submitted."""
    jobs: list[str] = field(default_factory=list)
    """The ids of every workload :func:`serve` submitted, in order."""

    def __post_init__(self) -> None:
        self.log_path = self.home / "daemon.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ, KUNLUN_HOME=str(self.home))
        for key in ("KUNLUN_ENDPOINT", "KUNLUN_API_KEY", "KUNLUN_REPLAY_DIR"):
            env.pop(key, None)
        env.update(extra)
        return env

    def cli(
        self, *args: str, remote: bool = True, key: str | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        extra = {"KUNLUN_ENDPOINT": self.url} if remote else {}
        if key:
            extra["KUNLUN_API_KEY"] = key
        return subprocess.run(
            [str(BIN / "kunlun-cli"), *args],
            capture_output=True,
            text=True,
            env=self.env(**extra),
            timeout=timeout,
        )

    def start(
        self,
        *args: str,
        wait_ready: bool = True,
        timeout: float = 300,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        deadline = time.monotonic() + timeout
        path = "/readyz" if wait_ready else "/healthz"
        tries = 3
        self.proc = self._spawn(args, extra_env)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                said = self.log()
                tries -= 1
                if tries and lost_port(said):
                    # another process took the free port between its choice and this start
                    self.port = free_port()
                    self.proc = self._spawn(args, extra_env)
                    continue
                pytest.fail(f"daemon exited with {self.proc.returncode}:\n{said}")
            try:
                if loopback.get(self.url + path, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        pytest.fail(f"daemon not {path} within {timeout}s:\n{self.log()}")

    def _spawn(
        self, args: tuple[str, ...], extra_env: dict[str, str] | None
    ) -> subprocess.Popen[bytes]:
        with self.log_path.open("ab") as log:
            return subprocess.Popen(
                [str(BIN / "kunlun-platform"), "--port", str(self.port), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(**(extra_env or {})),
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return loopback.get(self.url + path, timeout=30, **kw)

    def worker_key(self, replica_id: str) -> dict[str, str]:
        """The header ``replica_id``'s worker asks of every request (the key of its start,
        from the launch file only the daemon's user may read): for tests that read a worker
        directly."""
        launch = self.home / "run" / "workers" / f"{replica_id}.launch.json"
        return {"X-Kunlun-Worker-Key": json.loads(launch.read_text())["access_key"]}

    def describe(self, job: str, key: str | None = None) -> dict[str, Any]:
        proc = self.cli("workload", "describe", job, "--json", key=key)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    def create_key(self, name: str, *options: str, remote: bool = False) -> str:
        """A new API key ``name`` (``options`` such as ``--scope admin``), made on the home
        directly unless ``remote`` (then through the daemon with the first admin key)."""
        admin = next(iter(self.keys.values()), None) if remote else None
        made = self.cli("apikey", "create", name, *options, "--json", remote=remote, key=admin)
        assert made.returncode == 0, made.stderr
        self.keys[name] = str(json.loads(made.stdout)["key"])
        return self.keys[name]

    def submit(self, spec: str, key: str | None = None, name: str = "spec") -> str:
        """Submit ``spec`` (YAML text) through the CLI and return the workload id."""
        path = self.home / f"{name}.yaml"
        path.write_text(spec)
        key = key if key is not None else next(iter(self.keys.values()), None)
        proc = self.cli("workload", "submit", "--file", str(path), "--json", key=key)
        assert proc.returncode == 0, proc.stderr
        return str(json.loads(proc.stdout)["workload_id"])


def make_home(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    models_home: Path | None = None,
    declaration: str | None = ONE_THREAD,
) -> Path:
    """A fresh KUNLUN_HOME declaring one thread per CPU worker (:data:`ONE_THREAD`, or
    ``declaration``; None writes none). With ``models_home`` its model catalog already holds
    the demo model ``smollm2`` (the models folder is shared, not copied)."""
    home = tmp_path_factory.mktemp(name)
    if models_home is not None:
        shutil.copy(models_home / "state.db", home / "state.db")
        (home / "models").symlink_to(models_home / "models")
    if declaration is not None:
        (home / "device-plugin-config.yaml").write_text(declaration)
    return home


PATIENT = ("scheduler_config.yaml", "max_queue_wait_s: 600\n")
"""A :class:`Profile` file letting requests wait up to 600 s for a slot: validate's 20
concurrent requests queue behind a few slots, which on a loaded CI machine can take longer
than the default 60 s; the tests check answers, not speed."""


TINY = TINY_SPEC.format(path="{tiny}", name="tiny")
"""The tiny model as workload ``tiny``, in a :class:`Profile`."""


@dataclass(frozen=True)
class Profile:
    """A daemon of the suite: what it serves and how it is set up, as data.

    Every daemon the tests start is one of these, started by :func:`serve` (the one place a
    daemon is started; a test that stops its daemon on purpose restarts it with
    :meth:`Daemon.start` again). ``{tiny}`` in a workload, flag, environment value or file is the
    tiny model's path, ``{home}`` the daemon's home and ``{base}`` the run's temporary root.
    """

    name: str
    """The home's folder name."""
    workloads: tuple[str, ...] = ()
    """YAML specs submitted once the daemon answers; it is ready when each has a replica."""
    args: tuple[str, ...] = ()
    """``kunlun-platform`` flags."""
    keys: tuple[tuple[str, ...], ...] = ()
    """``(name, scope, *options)`` API keys made on the home before it starts (options of
    ``apikey create``, such as ``--allow-ip``); the first submits the workloads."""
    env: tuple[tuple[str, str], ...] = ()
    files: tuple[tuple[str, str], ...] = ()
    """``(path in the home, text)`` written before it starts (``scheduler_config.yaml``...)."""
    demo: bool = False
    """The home's catalog holds the demo model as ``smollm2``."""
    declaration: str | None = ONE_THREAD
    """The home's device declaration (None: none)."""
    ready: bool = False
    """Wait for ``/readyz`` too (a model served by ``--model`` rather than a workload)."""

    def needs(self, placeholder: str) -> bool:
        texts = (
            *self.workloads,
            *self.args,
            *(v for _, v in self.env),
            *(t for _, t in self.files),
        )
        return any(placeholder in text for text in texts)


@contextlib.contextmanager
def serve(profile: Profile, home: Path, values: dict[str, str] | None = None) -> Iterator[Daemon]:
    """A daemon of ``profile`` on ``home`` (made by :func:`make_home`, or by the test),
    yielded once it is ready, stopped (and its large files pruned) at the end. ``values``
    fill the profile's placeholders (``tiny``, ``base``)."""
    fill = {"home": str(home), **(values or {})}

    def filled(text: str) -> str:
        for name, value in fill.items():
            text = text.replace("{" + name + "}", value)
        return text

    for path, text in profile.files:
        (home / path).write_text(filled(text))
    daemon = Daemon(home, free_port())
    for name, scope, *options in profile.keys:
        daemon.create_key(name, "--scope", scope, *options)
    env = {name: filled(value) for name, value in profile.env}
    daemon.start(*map(filled, profile.args), wait_ready=False, extra_env=env)
    try:
        specs = [filled(spec) for spec in profile.workloads]
        ids = [daemon.submit(spec, name=f"spec-{i}") for i, spec in enumerate(specs)]
        if ids:
            daemon.job, daemon.jobs = ids[0], ids
            wait_running(daemon, ids, timeout=600)
        if profile.ready:
            wait_ready(daemon)
        yield daemon
    finally:
        daemon.stop()
        prune(home)


class Daemons:
    """Starts daemons of :class:`Profile` for a test (the ``daemons`` fixture), filling the
    placeholders from the session's fixtures (the tiny model is made only when asked for)."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self.request = request
        self.factory: pytest.TempPathFactory = request.getfixturevalue("tmp_path_factory")

    def home(self, profile: Profile) -> Path:
        models = self.request.getfixturevalue("models_home") if profile.demo else None
        return make_home(self.factory, profile.name, models, profile.declaration)

    def values(self, profile: Profile) -> dict[str, str]:
        values = {"base": str(self.factory.getbasetemp())}
        if profile.needs("{tiny}"):
            values["tiny"] = str(self.request.getfixturevalue("tiny_model"))
        return values

    def serve(
        self, profile: Profile, home: Path | None = None
    ) -> contextlib.AbstractContextManager[Daemon]:
        """:func:`serve` on ``home``, or a new home for ``profile``."""
        return serve(profile, home or self.home(profile), self.values(profile))


def daemon_fixture(profile: Profile, scope: str = "module") -> Any:
    """The fixture of a daemon of ``profile``, started once per ``scope`` (``session``: once
    per run for every file that asks, see ``tests/conftest.py``)."""

    def fixture(request: pytest.FixtureRequest) -> Iterator[Daemon]:
        with Daemons(request).serve(profile) as daemon:
            yield daemon

    fixture.shared_profile = profile if scope == "session" else None  # type: ignore[attr-defined]
    return pytest.fixture(scope=scope)(fixture)  # type: ignore[call-overload]


def shared_profiles(item: pytest.Item) -> list[Profile]:
    """The profiles of the session-wide daemons ``item`` uses."""
    info = getattr(item, "_fixtureinfo", None)
    return [
        profile
        for defs in (info.name2fixturedefs.values() if info else ())
        if (profile := getattr(defs[-1].func, "shared_profile", None)) is not None
    ]


LARGE = 1 << 20
"""Files from this size up (weights, exports, packages, write-ahead logs) are removed from a
stopped daemon's home, or a stopped etcd's data, by :func:`prune`."""


def prune(root: Path) -> None:
    """Remove the large files under ``root`` once what wrote them has stopped: a run makes
    GBs of them (converted weights in plan caches, GGUF exports, etcd's preallocated logs)
    and keeps its folders to the end (or, red, after it); what is read to see why a test
    failed (logs, state, plans) is small and stays."""
    for path in root.rglob("*"):
        kept = path.is_symlink() or not path.is_file() or path.name.endswith(".log")
        if not kept and path.stat().st_size >= LARGE:
            path.unlink()


def answers(url: str) -> bool:
    """Whether a daemon answers ``/healthz`` at ``url``."""
    try:
        return loopback.get(url + "/healthz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def refused(
    home: Path,
    *args: str,
    env: dict[str, str] | None = None,
    port: int | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """``kunlun-platform`` on ``home`` (``args`` its flags after ``--port``; ``env`` added to
    a clean environment), which must refuse to start: its exit status and output. Fails the
    test at once, stopping it, if it serves instead. Every start-up refusal in the suite
    goes through here; none needs a worker."""
    daemon = Daemon(home, port if port is not None else free_port())
    taken = port is not None and answers(daemon.url)  # another daemon's: not ours serving
    deadline = time.monotonic() + timeout
    for _ in range(3):
        proc = subprocess.Popen([str(BIN / "kunlun-platform"), "--port", str(daemon.port),
                                 *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=daemon.env(**(env or {})))  # fmt: skip
        while proc.poll() is None:
            if (not taken and answers(daemon.url)) or time.monotonic() > deadline:
                proc.terminate()
                out, err = proc.communicate(timeout=60)
                pytest.fail(
                    f"kunlun-platform {' '.join(args)} did not refuse to start:\n{out}{err}"
                )
            time.sleep(0.1)
        stdout, stderr = proc.communicate(timeout=60)
        if taken or not lost_port(stdout + stderr):
            break
        daemon.port = free_port()  # another process took the free port meanwhile: not the refusal
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def submit_demo(daemon: Daemon, extra: str = "") -> str:
    return daemon.submit(SPEC + extra)


def settled_request_log(
    home: Path, quiet_s: float = 0.8, timeout: float = 60
) -> list[dict[str, Any]]:
    """The entries of ``home``'s request log once it has stopped growing for ``quiet_s``
    (the daemon writes queued entries in batches, up to 0.5 s after each request ends)."""
    path = home / "logs" / "requests.jsonl"
    deadline = time.monotonic() + timeout
    size = -1
    while True:
        now = path.stat().st_size if path.exists() else 0
        if now == size or time.monotonic() > deadline:
            break
        size = now
        time.sleep(quiet_s)
    if not path.exists():
        return []
    # split on "\n" only: str.splitlines() would also split inside a line holding U+2028
    return [json.loads(line) for line in path.read_text().split("\n") if line.strip()]


def stream_lines(
    url: str,
    lines: list[str],
    started: threading.Event,
    max_tokens: int = 400,
    stop: threading.Event | None = None,
    model: str = "smollm2",
) -> None:
    """Stream a long completion of ``model`` from ``url`` into ``lines`` (its status first,
    then every non-empty SSE line); ``started`` is set at the first line and at the end.
    Setting ``stop`` makes the client leave after the next line (a disconnect)."""
    body = {"model": model, "prompt": "Count slowly:", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with loopback.stream("POST", url + "/v1/completions", json=body, timeout=300) as resp:
        lines.append(f"status {resp.status_code}")
        for line in resp.iter_lines():
            if line:
                lines.append(line)
                started.set()
            if stop is not None and stop.is_set():
                break
    started.set()


def wait_running(daemon: Daemon, ids: list[str], timeout: float = 300) -> None:
    """Wait until every workload of ``ids`` is RUNNING with a ready replica; fail at once,
    with its reason, when one ends FAILED or STOPPED."""
    key = next(iter(daemon.keys.values()), None)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    deadline = time.monotonic() + timeout
    while True:
        rows = {
            w["workload_id"]: w for w in daemon.get("/api/v1/workloads", headers=headers).json()
        }
        for workload_id in ids:
            row = rows.get(workload_id, {})
            if row.get("state") in ("FAILED", "STOPPED"):
                pytest.fail(f"workload {workload_id} {row['state']}: {row.get('reason')}")
        if all(rows.get(i, {}).get("state") == "RUNNING" and rows[i]["ready_replicas"] >= 1
               for i in ids):  # fmt: skip
            return
        if time.monotonic() > deadline:
            pytest.fail(f"workloads not RUNNING within {timeout}s: {rows}\n{daemon.log()}")
        time.sleep(0.1)


def wait_ready(daemon: Daemon, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while daemon.get("/readyz").status_code != 200:
        if time.monotonic() > deadline:
            pytest.fail(f"no replica ready:\n{daemon.log()}")
        time.sleep(0.1)


QUALITY_ROWS = {
    "numerics": ("numerics",),
    "answers": ("functional.short_text", "functional.long_text", "functional.multi_turn",
                "functional.special_chars"),
}  # fmt: skip
"""The battery's rows whose verdict depends on how a model computes, as two parts (``--only``
selections): the numbers (the ``numerics`` group) and the answers (right facts, a code
recalled from a long prompt and from five turns back, text copied verbatim); the
``quality`` rows run with every selection. These are what a quantization scheme or a weight
format changes, and the quantized and k-quant columns run them. The rest (``api``,
``perf``, and the functional rows of concurrency, sampling temperature and the batch
runner) check the serving path, the same for every column whatever its weights: they run
on llama.cpp and on the demo's fp32 column (``tests/validate/test_validate.py``; where bf16
is emulated, the functional ones there and ``api.sse``, ``api.usage``, ``perf.c1``).
Batched decoding through each scheme's kernels is checked token by token in
``tests/engine/test_quant_quality.py`` (8 prompts in one batch)."""


SPLIT = {"functional": 2, "api": 3}
"""Groups run as several tests of every n-th row each: the functional rows decode the most (a
3,000 character text, 20 concurrent requests, a batch of 10), and a whole group took up to
67 s under a full run's load; the api group on two columns where the CPU computes bf16
natively (the whole battery on the bf16 column too) took 76 s, and a half of it 61 s."""


def bf16_is_native() -> bool:
    """Whether this machine's CPU computes bf16 natively (its plans then choose bf16)."""
    from kunlun.device.inventory import build_inventory

    cpu = build_inventory().get("cpu:0") or {}
    return (cpu.get("attributes") or {}).get("bf16_native") == "yes"


def battery_parts() -> dict[str, tuple[str, ...]]:
    """The tests that run validate's whole battery run it one part per test:
    part name -> its row ids, every row in exactly one part, in the battery's order. A part
    is a group, or every n-th row of one of :data:`SPLIT` (``functional-1``,
    ``functional-2``); a row or group added to the battery is run without a change here."""
    from kunlun.validate.battery import all_checks
    from kunlun.validate.check import Settings

    rows: dict[str, list[str]] = {}
    for check in all_checks(Settings(Path("."))):
        rows.setdefault(check.row.group, []).append(check.row.id)
    parts: dict[str, tuple[str, ...]] = {}
    for group, ids in rows.items():
        if group in SPLIT:
            for i in range(SPLIT[group]):
                parts[f"{group}-{i + 1}"] = tuple(ids[i :: SPLIT[group]])
        else:
            parts[group] = tuple(ids)
    return parts


def assert_validate_passes(
    daemon: Daemon, model: str, out: Path, only: tuple[str, ...] = ()
) -> None:
    """``kunlun-cli validate`` on ``model`` through ``daemon`` (the rows or groups ``only``,
    else the whole battery) exits 0 and every cell of its matrix is PASS or SKIP (at least
    one PASS)."""
    rows = [arg for row in only for arg in ("--only", row)]
    proc = daemon.cli("validate", "--endpoint", daemon.url, "--model", model, "--out", str(out),
                      "--seed", "7", *rows, timeout=1200)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = json.loads((out / "validation.json").read_text())
    statuses = {cell["status"] for cell in run["cells"][model].values()}
    assert statuses <= {"PASS", "SKIP"} and "PASS" in statuses


@contextlib.contextmanager
def under_attack(attack: Callable[[], httpx.Response]) -> Iterator[list[int]]:
    """``attack`` sent over and over from two threads while the block runs; yields the list
    of statuses it got (filled in as they come)."""
    statuses: list[int] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            statuses.append(attack().status_code)

    threads = [threading.Thread(target=loop) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.5)  # the attack is under way
        yield statuses
    finally:
        stop.set()
        for thread in threads:
            thread.join(300)


def assert_unhurt(
    d: Daemon, normal: Callable[[], float], attack: Callable[[], httpx.Response]
) -> list[int]:
    """``normal()`` (a request that returns its seconds), sent while ``attack`` runs, takes at
    most 5 s more than its usual time (the median of three before), and the daemon's health
    answers: the budgets of issue 32 in one check. Returns the attack's statuses."""
    import statistics

    usual = statistics.median(normal() for _ in range(3))
    with under_attack(attack) as statuses:
        during = max(normal() for _ in range(3))
        assert loopback.get(d.url + "/healthz", timeout=5).status_code == 200
    print(f"usual {usual:.2f} s, during the attack {during:.2f} s; attack statuses "
          f"{sorted(set(statuses))} x{len(statuses)}")  # fmt: skip
    assert during <= usual + 5
    return statuses
