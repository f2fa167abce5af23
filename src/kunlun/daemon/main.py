"""``kunlun-platform``: start the daemon, or ``kunlun-platform stop`` it.

Binds 127.0.0.1:8470 by default. A non-loopback bind with no API key is refused unless
``--allow-insecure``. A port already in use is an error naming the port and, where it can be
found, the process holding it. State lives in ``KUNLUN_HOME``, private to the user (umask 077; what an older version left
readable is tightened at start); a state database that is present but unusable stops the
start with exit status 2 (:class:`~kunlun.errors.StateError`). The pid file
``KUNLUN_HOME/kunlun-platform.json`` also tells ``kunlun-cli`` where the daemon listens.
SIGTERM drains: new requests get 503, in-flight ones finish, workers stop, exit 0.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Annotated, Any

import psutil
import typer
import uvicorn

from kunlun import budgets
from kunlun.address import DEFAULT_HOST, DEFAULT_PORT
from kunlun.batch.jobs import MAX_RUNNING_JOBS
from kunlun.console import console, handle_errors
from kunlun.daemon.pidfile import PID_FILE, pid_info
from kunlun.daemon.request_log import RequestLogConfig
from kunlun.engine.schemes import listed
from kunlun.errors import ConfigError, KunlunError, Location
from kunlun.limits import DEFAULT_MAX_SEQUENCES
from kunlun.paths import kunlun_home, private_umask, secure_home
from kunlun.sandbox import SELF_TEST_FORBIDDEN_SYSCALL, SandboxPolicy

DRAIN_TIMEOUT_S = 120.0
MODEL_ROOTS_ENV = "KUNLUN_MODEL_ROOTS"

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, invoke_without_command=True)

# Watching engine workers: the liveness kill (kunlun.node.liveness), the health checks'
# ejection from routing (kunlun.node.health, docs/health-checks.md).
AnswerDeadline = Annotated[float, typer.Option(min=0.5, envvar="KUNLUN_WORKER_ANSWER_DEADLINE_S", help=
    "A ready engine worker that answers no health probe for this long is killed and restarted; its requests get 504.")]  # fmt: skip
ProgressDeadline = Annotated[float, typer.Option(min=0.5, envvar="KUNLUN_WORKER_PROGRESS_DEADLINE_S", help=
    "An engine worker with requests in flight whose engine makes no step for this long is killed and restarted; its requests get 504.")]  # fmt: skip
HealthInterval = Annotated[float, typer.Option(min=0.2, envvar="KUNLUN_HEALTH_CHECK_INTERVAL_S", help=
    "Seconds between two health probes (a 1-token generation) of each ready replica.")]  # fmt: skip
HealthTimeout = Annotated[float, typer.Option(min=0.05, envvar="KUNLUN_HEALTH_CHECK_TIMEOUT_S", help=
    "Seconds a health probe waits; a replica that answers neither it nor /stats leaves routing at once.")]  # fmt: skip
HealthFailures = Annotated[int, typer.Option(min=1, envvar="KUNLUN_HEALTH_CHECK_FAILURES", help=
    "Failed health probes in a row (an error answer, or an engine with requests and no step) that take a replica out of routing until one passes.")]  # fmt: skip


class DaemonError(KunlunError):
    code = "daemon.error"
    exit_code = 2


def _holder(port: int) -> str:
    try:
        for c in psutil.net_connections(kind="inet"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                return f"{psutil.Process(c.pid).name()} (pid {c.pid})"
    except (psutil.Error, OSError):
        pass
    return "another process"


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(
        family, socket.SOCK_STREAM, socket.IPPROTO_TCP
    )  # asyncio sets TCP_NODELAY only then
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == 98:  # EADDRINUSE
            raise DaemonError(
                f"port {port} on {host} is already in use by {_holder(port)}",
                location=Location("--port"),
                hint="stop that process or pass --port",
            ) from None
        raise DaemonError(
            f"cannot bind {host}:{port}: {exc.strerror}", location=Location("--host")
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class DrainingServer(uvicorn.Server):
    """uvicorn, but SIGTERM/SIGINT first drain: 503 for new requests, in-flight ones finish."""

    def __init__(self, config: uvicorn.Config, platform: Any) -> None:
        super().__init__(config)
        self.platform = platform
        self.draining = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.draining:  # a second signal: stop now
            self.should_exit = self.force_exit = True
            return
        self.draining = True
        self.platform.gateway.draining = True
        print(f"received signal {sig}: draining (new requests get 503)", flush=True)
        asyncio.get_event_loop().call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline and self.platform.gateway.num_active > 0:
            await asyncio.sleep(0.05)
        print("drained; stopping engine workers", flush=True)
        self.should_exit = True


@app.callback()
@handle_errors
def serve(
    ctx: typer.Context,
    host: Annotated[str, typer.Option(help="Address to bind.")] = DEFAULT_HOST,
    port: Annotated[int, typer.Option(help="Port to bind.", min=1, max=65535)] = DEFAULT_PORT,
    allow_insecure: Annotated[
        bool, typer.Option("--allow-insecure", help="Allow a non-loopback bind with no API key.")
    ] = False,
    allowed_origins: Annotated[
        str | None,
        typer.Option(
            envvar="KUNLUN_ALLOWED_ORIGINS",
            help="Browser origins allowed to call the API (CORS), comma-separated, e.g. "
            "https://app.example.com; '*' for any. Without it: no CORS headers.",
        ),
    ] = None,
    forwarded_allow_ips: Annotated[
        str | None,
        typer.Option(
            envvar="KUNLUN_FORWARDED_ALLOW_IPS",
            help="Proxies whose X-Forwarded-For (the client's address, which API keys' "
            "allow-lists check) and X-Forwarded-Proto are believed: comma-separated addresses "
            "or networks, e.g. 10.0.0.5,10.1.0.0/16. Without it no proxy header is believed.",
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="KUNLUN_API_KEY",
            show_envvar=True,
            help="A fixed admin API key for this run, not stored (containers, CI); stored keys "
            "(kunlun-cli apikey) work beside it.",
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            help="device-plugin-config.yaml (default: KUNLUN_HOME/device-plugin-config.yaml if present)."
        ),
    ] = None,
    demo: Annotated[
        bool, typer.Option("--demo", help="Import the demo model and serve it as 'smollm2'.")
    ] = False,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="Serve this model from the start: an alias, a model directory, a GGUF file, or "
            "a Hugging Face repo id already in the local cache (nothing is downloaded).",
        ),
    ] = None,
    served_model_name: Annotated[
        str | None, typer.Option(help="With --model: the name clients use (vLLM's flag).")
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(help="With --model: auto, float32, bfloat16, float16 (or fp32, bf16, fp16)."),
    ] = None,
    max_model_len: Annotated[
        int | None, typer.Option(min=1, help="With --model: the context window.")
    ] = None,
    max_num_seqs: Annotated[
        int | None,
        typer.Option(min=1, help="With --model: sequences decoded together (batch_size)."),
    ] = None,
    tensor_parallel_size: Annotated[
        int | None, typer.Option(min=1, help="With --model: devices one replica spans.")
    ] = None,
    quantization: Annotated[
        str | None,
        typer.Option(
            "--quantization",
            "--quantize",
            help=f"With --model: {listed()} (quantized while loading).",
        ),
    ] = None,
    task: Annotated[
        str | None, typer.Option(help="With --model: generate (default) or embed.")
    ] = None,
    pooling: Annotated[
        str | None, typer.Option(help="With --model --task embed: mean (default) or last.")
    ] = None,
    gpu_memory_utilization: Annotated[
        float | None,
        typer.Option(
            help="With --model: fraction of each device's memory (0 < F <= 1) for "
            "weights and KV cache (default 0.9; on a CPU it lifts the 1 GiB KV cap)."
        ),
    ] = None,
    chat_template: Annotated[
        str | None,
        typer.Option(
            help="With --model: a chat template file, or the template text, used "
            "instead of the model's own."
        ),
    ] = None,
    scheduler_config: Annotated[
        Path | None,
        typer.Option(
            help="scheduler_config.yaml (default: KUNLUN_HOME/scheduler_config.yaml if present); "
            "reloaded when it changes."
        ),
    ] = None,
    request_log_max_mb: Annotated[
        int,
        typer.Option(
            min=1,
            envvar="KUNLUN_REQUEST_LOG_MAX_MB",
            help="Rotate KUNLUN_HOME/logs/requests.jsonl past this many MiB.",
        ),
    ] = 64,
    request_log_backups: Annotated[
        int,
        typer.Option(
            min=0,
            envvar="KUNLUN_REQUEST_LOG_BACKUPS",
            help="Rotated request logs kept (requests.jsonl.1 ... .N).",
        ),
    ] = 5,
    request_log_flush_s: Annotated[
        float,
        typer.Option(
            min=0.01,
            max=60.0,
            envvar="KUNLUN_REQUEST_LOG_FLUSH_S",
            help="Longest time a request log entry waits in memory before it is written.",
        ),
    ] = 0.5,
    batch_max_jobs: Annotated[
        int,
        typer.Option(
            min=1,
            envvar="KUNLUN_BATCH_MAX_JOBS",
            help="Batch API jobs that run at once; later ones wait (status 'validating').",
        ),
    ] = MAX_RUNNING_JOBS,
    model_root: Annotated[
        list[Path] | None,
        typer.Option(
            help="A directory GGUF imports through the daemon may read from (repeatable; "
            "also KUNLUN_MODEL_ROOTS, ':'-separated, and model_roots in "
            "scheduler_config.yaml; KUNLUN_HOME/models and the demo package always are).",
        ),
    ] = None,
    max_sequences_per_request: Annotated[
        int,
        typer.Option(
            min=1,
            envvar="KUNLUN_MAX_SEQUENCES_PER_REQUEST",
            help="Most sequences one inference request may ask for (prompts x n); more: 400.",
        ),
    ] = DEFAULT_MAX_SEQUENCES,
    worker_sandbox: Annotated[
        bool,
        typer.Option(
            "--worker-sandbox/--no-worker-sandbox",
            envvar="KUNLUN_WORKER_SANDBOX",
            help="Confine engine workers (clean environment, rlimits, seccomp; docs/sandbox.md). "
            "Off is for debugging only.",
        ),
    ] = True,
    worker_self_test: Annotated[
        str | None,
        typer.Option(hidden=True, envvar="KUNLUN_WORKER_SELF_TEST"),
    ] = None,
    worker_answer_deadline_s: AnswerDeadline = 15.0,
    worker_progress_deadline_s: ProgressDeadline = 120.0,
    health_check_interval: HealthInterval = 5.0,
    health_check_timeout: HealthTimeout = 2.0,
    health_check_failures: HealthFailures = 2,
    upstream_first_byte_timeout_s: Annotated[
        float,
        typer.Option(
            min=1.0,
            envvar="KUNLUN_UPSTREAM_FIRST_BYTE_TIMEOUT_S",
            help="Longest wait for a worker's response head (a non-streamed answer comes "
            "whole, once generated); past it, 504.",
        ),
    ] = 900.0,
    require_signed: Annotated[
        bool,
        typer.Option(
            "--require-signed",
            envvar="KUNLUN_REQUIRE_SIGNED",
            help="Serve only models installed from signed packages (kunlun-installer), and "
            "only a device-plugin-config.yaml with a valid detached signature (.sig).",
        ),
    ] = False,
    trusted_keys: Annotated[
        list[Path] | None,
        typer.Option(
            help="Trusted public keys: a directory of *.pub or a key file (repeatable; "
            "default KUNLUN_HOME/trusted-keys).",
        ),
    ] = None,
    integrity_interval_s: Annotated[
        float,
        typer.Option(
            "--integrity-interval",
            min=1.0,
            envvar="KUNLUN_INTEGRITY_INTERVAL_S",
            help="Seconds between re-hashes of the served packages and the platform's files.",
        ),
    ] = 300.0,
    cluster_etcd: Annotated[
        str | None,
        typer.Option(
            envvar="KUNLUN_CLUSTER_ETCD",
            help="Join a cluster: its etcd client URLs, comma-separated (docs/cluster.md). "
            "The state then lives in etcd, shared by every node.",
        ),
    ] = None,
    node_name: Annotated[
        str | None,
        typer.Option(envvar="KUNLUN_NODE_NAME", help="This node's name in the cluster."),
    ] = None,
    peer_port: Annotated[
        int | None,
        typer.Option(
            min=1, max=65535, help="Port other nodes relay requests to (default: --port + 1)."
        ),
    ] = None,
    advertise_url: Annotated[
        str | None,
        typer.Option(
            help="How other nodes reach this node's peer port (default: https://HOST:PEER_PORT)."
        ),
    ] = None,
    cluster_certs: Annotated[
        Path | None,
        typer.Option(
            envvar="KUNLUN_CLUSTER_CERTS",
            help="Directory with ca.crt and NODE_NAME.crt/.key (kunlun-cli cluster certs): TLS "
            "to etcd and between nodes.",
        ),
    ] = None,
    cluster_files: Annotated[
        Path | None,
        typer.Option(
            envvar="KUNLUN_CLUSTER_FILES",
            help="A directory every node of the cluster mounts (shared storage): Batch API "
            "files and journals, so another node can resume a lost node's batch.",
        ),
    ] = None,
    insecure_cluster: Annotated[
        bool,
        typer.Option(
            "--insecure-cluster",
            help="Plain HTTP to etcd and between nodes, no certificates (a test cluster only).",
        ),
    ] = False,
    cluster_lease_ttl_s: Annotated[
        int,
        typer.Option(
            "--cluster-lease-ttl",
            min=2,
            max=300,
            help="Seconds a node stays in the cluster without renewing its lease (a lost node is "
            "noticed, and a new leader elected, within this).",
        ),
    ] = 10,
    upstream_read_timeout_s: Annotated[
        float,
        typer.Option(
            min=1.0,
            envvar="KUNLUN_UPSTREAM_READ_TIMEOUT_S",
            help="Longest silence between two pieces of a worker's streamed answer; past it, "
            "the stream ends with a 504 error event.",
        ),
    ] = 300.0,
) -> None:
    """Run the Kunlun Platform daemon in the foreground."""
    if ctx.invoked_subcommand is not None:
        return
    from kunlun.daemon.app import check_origins, check_proxies, create_asgi, make_platform
    from kunlun.node.health import HealthConfig
    from kunlun.node.liveness import LivenessConfig

    home = kunlun_home()
    running = pid_info(home)
    if running:
        raise DaemonError(
            f"a daemon already runs for {home} (pid {running['pid']}, port {running['port']})",
            hint="kunlun-platform stop",
        )
    tightened = secure_home(home)
    if tightened:
        console.print(
            f"made {tightened} path(s) under {home} private (directories 0700, files 0600)"
        )
    if config is None and (home / "device-plugin-config.yaml").exists():
        config = home / "device-plugin-config.yaml"
    if config is not None and not config.exists():
        raise ConfigError("device config not found", location=Location(str(config)))
    if scheduler_config is not None and not scheduler_config.exists():
        raise ConfigError("scheduler config not found", location=Location(str(scheduler_config)))
    log_config = RequestLogConfig(
        max_bytes=request_log_max_mb << 20,
        num_backups=request_log_backups,
        flush_interval_s=request_log_flush_s,
    )
    if worker_self_test not in (None, SELF_TEST_FORBIDDEN_SYSCALL):
        raise ConfigError(
            f"unknown worker self-test {worker_self_test!r}",
            location=Location("KUNLUN_WORKER_SELF_TEST"),
            hint=f"the only one is {SELF_TEST_FORBIDDEN_SYSCALL!r}",
        )
    given = {"--served-model-name": served_model_name, "--dtype": dtype,
             "--max-model-len": max_model_len, "--max-num-seqs": max_num_seqs,
             "--tensor-parallel-size": tensor_parallel_size, "--quantization": quantization,
             "--task": task, "--pooling": pooling, "--chat-template": chat_template,
             "--gpu-memory-utilization": gpu_memory_utilization}  # fmt: skip
    if model is None and any(v is not None for v in given.values()):
        flags = ", ".join(k for k, v in given.items() if v is not None)
        raise ConfigError(f"{flags} only apply with --model", location=Location("--model"))
    sandbox = SandboxPolicy(home, enabled=worker_sandbox, self_test=worker_self_test)
    roots = model_roots(model_root or [])
    from kunlun.offline.integrity import daemon_guard

    guard = daemon_guard(home, config, require_signed, trusted_keys)
    cluster = None
    peer_sock = None
    if cluster_etcd is not None:
        from kunlun.cluster import member

        peer_port = peer_port or port + 1
        cluster = member.cluster_config(cluster_etcd, node_name, host, port, peer_port, advertise_url,
                                 cluster_certs, insecure_cluster, cluster_lease_ttl_s,
                                 cluster_files)  # fmt: skip
        peer_sock = bind_socket(host, peer_port)
    elif node_name or cluster_certs or advertise_url or insecure_cluster or cluster_files:
        raise ConfigError(
            "cluster options need --cluster-etcd", location=Location("--cluster-etcd")
        )
    platform = make_platform(
        home,
        config,
        scheduler_config,
        log_config,
        batch_max_jobs,
        roots,
        sandbox=sandbox,
        liveness=LivenessConfig(
            answer_deadline_s=worker_answer_deadline_s,
            probe_timeout_s=min(LivenessConfig.probe_timeout_s, worker_answer_deadline_s),
            progress_deadline_s=worker_progress_deadline_s,
        ),
        upstream_timeouts_s=(upstream_first_byte_timeout_s, upstream_read_timeout_s),
        guard=guard,
        integrity_interval_s=integrity_interval_s,
        cluster=cluster,
        health=HealthConfig(health_check_interval, health_check_timeout, health_check_failures),
    )
    if cluster is not None and peer_sock is not None:
        from kunlun.cluster.peer import PeerApp, PeerServer

        context = None if cluster.tls is None else cluster.tls.server_context()
        peer_app = PeerApp(cluster.node_name, platform.replicas)
        platform.peer = PeerServer(peer_app, peer_sock, context)
        if platform.cluster is not None:
            platform.cluster.local.peer_in_flight = lambda rid: peer_app.in_flight.get(rid, 0)
    platform.gateway.max_sequences_per_request = max_sequences_per_request
    if api_key is not None:
        platform.keyring.add_fixed(api_key, "--api-key / KUNLUN_API_KEY")
    platform.allowed_origins = check_origins(allowed_origins)
    proxies = check_proxies(forwarded_allow_ips)
    budgets.check()  # a bad KUNLUN_BUDGET_* stops the start here, named
    if not _is_loopback(host) and not platform.keyring.enabled and not allow_insecure:
        raise DaemonError(
            f"refusing to listen on {host} with no API key configured",
            location=Location("--host"),
            hint="kunlun-cli apikey create NAME first, or pass --allow-insecure",
        )
    sock = bind_socket(host, port)
    if demo:
        _ensure_demo(platform)
    if model is not None:
        _serve_at_start(platform, model, {
            "name": served_model_name, "dtype": dtype, "max_model_len": max_model_len,
            "batch_size": max_num_seqs, "tensor_parallel_size": tensor_parallel_size,
            "quantization": quantization, "task": task, "pooling": pooling,
            "memory_utilization": gpu_memory_utilization, "chat_template": chat_template})  # fmt: skip
    server = DrainingServer(
        uvicorn.Config(
            create_asgi(platform),
            log_level="warning",
            timeout_graceful_shutdown=30,
            proxy_headers=bool(proxies),
            forwarded_allow_ips=list(proxies) or None,
        ),
        platform,
    )
    pid_path = home / PID_FILE
    pid_path.write_text(
        json.dumps(
            {
                "pid": os.getpid(),
                "create_time": psutil.Process().create_time(),
                "host": host,
                "port": port,
                "cluster": None if cluster is None else cluster.node_name,
            }
        )
    )
    console.print(f"Kunlun Platform listening on http://{host}:{port} (KUNLUN_HOME={home})")
    try:
        server.run(sockets=[sock])
    finally:
        pid_path.unlink(missing_ok=True)
    raise SystemExit(0)


def model_roots(flags: list[Path]) -> tuple[Path, ...]:
    """The ``--model-root`` directories and those of ``KUNLUN_MODEL_ROOTS``, resolved; one
    that is not a directory is a :class:`ConfigError` naming it and where it came from."""
    sources = [(path, "--model-root") for path in flags]
    env = os.environ.get(MODEL_ROOTS_ENV, "")
    sources += [(Path(item), MODEL_ROOTS_ENV) for item in env.split(os.pathsep) if item.strip()]
    roots = []
    for path, origin in sources:
        if not path.expanduser().is_dir():
            raise ConfigError(
                f"model root {str(path)!r} is not a directory", location=Location(origin)
            )
        roots.append(path.expanduser().resolve())
    return tuple(roots)


DTYPES = {
    "auto": None,
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "fp32": "fp32",
    "bf16": "bf16",
    "fp16": "fp16",
}
"""``--dtype`` values: vLLM's spellings and Kunlun's, to the workload spec's (None: the
planner chooses)."""


def _serve_at_start(platform: Any, source: str, fields: dict[str, Any]) -> None:
    """``--model``: resolve ``source`` (:func:`kunlun.catalog.model_source`) and submit a
    workload for it, unless one of that name is already active."""
    from kunlun import catalog
    from kunlun.workload.chat_template import read_chat_template
    from kunlun.workload.spec import parse_spec

    if fields.get("chat_template") is not None:  # the spec holds the text, not a path
        fields["chat_template"] = read_chat_template(fields["chat_template"])
    spec_model, default_name = catalog.model_source(platform.store, source)
    if fields.get("dtype") is not None:
        if fields["dtype"] not in DTYPES:
            raise ConfigError(
                f"--dtype {fields['dtype']!r} is not one of {', '.join(DTYPES)}",
                location=Location("--dtype"),
            )
        fields["dtype"] = DTYPES[fields["dtype"]]
    data = {"model": spec_model, **{k: v for k, v in fields.items() if v is not None}}
    data.setdefault("name", default_name)
    spec = parse_spec(data, "--model and its options")
    active = [w for w in platform.store.list_workloads()
              if w.name == spec.name and w.state not in ("STOPPED", "FAILED")]  # fmt: skip
    if active:
        console.print(f"serving {spec.name!r}: workload {active[0].workload_id} is already active")
        return
    platform.manager.create(spec)  # created PENDING; the app's start-up starts it
    console.print(f"serving {source} as {spec.name!r}")


def _ensure_demo(platform: Any) -> None:
    from kunlun import catalog
    from kunlun.workload.spec import WorkloadSpec

    if platform.store.get_model(catalog.DEMO_ALIAS) is None:
        console.print("importing the demo model (SmolLM2-135M-Instruct) ...")
        catalog.import_demo(platform.store)
    active = [
        w
        for w in platform.store.list_workloads()
        if w.name == catalog.DEMO_ALIAS and w.state not in ("STOPPED", "FAILED")
    ]
    if not active:  # created PENDING; the app's start-up starts every active workload
        platform.manager.create(WorkloadSpec.model_validate({"model": catalog.DEMO_ALIAS}))


@app.command()
@handle_errors
def stop(
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the drain.")] = 150.0,
) -> None:
    """Stop the running daemon (SIGTERM: it drains first)."""
    home = kunlun_home()
    info = pid_info(home)
    if info is None:
        raise DaemonError(f"no daemon is running for {home}")
    pid = int(info["pid"])
    os.kill(pid, signal.SIGTERM)
    try:
        psutil.Process(pid).wait(timeout)
    except psutil.TimeoutExpired:
        raise DaemonError(f"daemon pid {pid} did not stop within {timeout:g}s") from None
    except psutil.NoSuchProcess:
        pass
    console.print(f"stopped (pid {pid})")


def main() -> None:
    private_umask()  # everything the daemon and its workers create is the user's alone
    app()
