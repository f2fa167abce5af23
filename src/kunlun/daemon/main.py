"""``kunlun-platform``: start the daemon, or ``kunlun-platform stop`` it.

Binds 127.0.0.1:8470 by default. A non-loopback bind with no API key is refused unless
``--allow-insecure``. A port already in use is an error naming the port and, where it can be
found, the process holding it. State lives in ``KUNLUN_HOME``, private to the user (umask 077; what an older version left
readable is tightened at start); a state database that is present but unusable stops the
start with exit status 2 (:class:`~kunlun.errors.StateError`). The pid file
``KUNLUN_HOME/kunlun-platform.json`` also tells ``kunlun-cli`` where the daemon listens.
SIGTERM drains: new requests get 503, in-flight ones finish, workers stop, exit 0.

The options are the fields of :class:`~kunlun.daemon.settings.DaemonSettings`; :func:`serve`
gets them as one object and runs in stages: :func:`check` (refusals before anything is
made), :func:`make_daemon_platform` (with :func:`join_cluster` in a cluster), :func:`bind`,
the models served at start (``--demo``, ``--model``), :func:`run`.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import psutil
import typer

from kunlun import budgets
from kunlun.console import console, handle_errors
from kunlun.daemon.pidfile import PID_FILE, pid_info
from kunlun.daemon.settings import DTYPES, DaemonSettings, settings_command
from kunlun.errors import ConfigError, KunlunError, Location
from kunlun.paths import kunlun_home, private_umask, secure_home
from kunlun.sandbox import SELF_TEST_FORBIDDEN_SYSCALL, SandboxPolicy
from kunlun.workload.spec import WorkloadSpec, parse_spec

if TYPE_CHECKING:  # the app and a cluster's modules load only when the daemon starts
    from kunlun.cluster.member import ClusterConfig
    from kunlun.daemon.app import Platform

MODEL_ROOTS_ENV = "KUNLUN_MODEL_ROOTS"

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, invoke_without_command=True)


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


LISTEN_BACKLOG = 2048


def bind_socket(host: str, port: int, listen: bool = True) -> socket.socket:
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
    if listen:
        sock.listen(LISTEN_BACKLOG)
    sock.set_inheritable(True)
    return sock


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@app.callback()
@handle_errors
@settings_command(DaemonSettings)
def serve(ctx: typer.Context, settings: DaemonSettings) -> None:
    """Run the Kunlun Platform daemon in the foreground."""
    if ctx.invoked_subcommand is not None:
        return
    home = kunlun_home()
    settings = check(settings, home)
    platform = make_daemon_platform(settings, home)
    sock, proxies = bind(settings, platform)
    pid_path = write_pid_file(home, settings, platform)
    try:
        # only now does the port take connections: whoever reaches it (a script that waits
        # for the port, then runs kunlun-cli) finds the pid file, and with it the address
        sock.listen(LISTEN_BACKLOG)
        if settings.demo:
            _ensure_demo(platform)
        if settings.model is not None:
            _serve_at_start(platform, settings.model, settings.served_fields())
        run(settings, platform, sock, proxies)
    finally:
        pid_path.unlink(missing_ok=True)


def write_pid_file(home: Path, settings: DaemonSettings, platform: Platform) -> Path:
    """The pid file under ``home``, by which the CLI finds this daemon's address."""
    cluster = platform.cluster
    pid_path = home / PID_FILE
    pid_path.write_text(
        json.dumps(
            {
                "pid": os.getpid(),
                "create_time": psutil.Process().create_time(),
                "host": settings.host,
                "port": settings.port,
                "cluster": None if cluster is None else cluster.config.node_name,
            }
        )
    )
    return pid_path


def check(settings: DaemonSettings, home: Path) -> DaemonSettings:
    """What stops a start before anything is made: a daemon already running for ``home``,
    a config file named but absent, an unknown worker self-test, ``--model`` options without
    ``--model``. Makes ``home`` private; the settings come back with the default device
    config resolved."""
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
    config = settings.config
    if config is None and (home / "device-plugin-config.yaml").exists():
        config = home / "device-plugin-config.yaml"
    if config is not None and not config.exists():
        raise ConfigError("device config not found", location=Location(str(config)))
    if settings.scheduler_config is not None and not settings.scheduler_config.exists():
        raise ConfigError(
            "scheduler config not found", location=Location(str(settings.scheduler_config))
        )
    if settings.worker_self_test not in (None, SELF_TEST_FORBIDDEN_SYSCALL):
        raise ConfigError(
            f"unknown worker self-test {settings.worker_self_test!r}",
            location=Location("KUNLUN_WORKER_SELF_TEST"),
            hint=f"the only one is {SELF_TEST_FORBIDDEN_SYSCALL!r}",
        )
    if settings.model is None and (flags := settings.served_flags()):
        raise ConfigError(
            f"{', '.join(flags)} only apply with --model", location=Location("--model")
        )
    return settings.model_copy(update={"config": config})


def make_daemon_platform(settings: DaemonSettings, home: Path) -> Platform:
    """The daemon's parts (:func:`kunlun.daemon.app.make_platform`) as the settings say:
    the worker sandbox, the model roots, which models may be served, the cluster if one is
    joined (with its peer port), the gateway's limits, a fixed API key, CORS origins."""
    from kunlun.daemon.app import make_platform
    from kunlun.daemon.request_log import RequestLogConfig
    from kunlun.node.health import HealthConfig
    from kunlun.node.liveness import LivenessConfig
    from kunlun.offline.integrity import daemon_guard

    sandbox = SandboxPolicy(
        home, enabled=settings.worker_sandbox, self_test=settings.worker_self_test
    )
    roots = model_roots(settings.model_root or [])
    guard = daemon_guard(home, settings.config, settings.require_signed, settings.trusted_keys)
    cluster, peer_sock = join_cluster(settings)
    answer_s = settings.worker_answer_deadline_s
    platform = make_platform(
        home,
        settings.config,
        settings.scheduler_config,
        RequestLogConfig(
            max_bytes=settings.request_log_max_mb << 20,
            num_backups=settings.request_log_backups,
            flush_interval_s=settings.request_log_flush_s,
        ),
        settings.batch_max_jobs,
        roots,
        sandbox=sandbox,
        liveness=LivenessConfig(
            answer_deadline_s=answer_s,
            probe_timeout_s=min(LivenessConfig.probe_timeout_s, answer_s),
            progress_deadline_s=settings.worker_progress_deadline_s,
        ),
        upstream_timeouts_s=(
            settings.upstream_first_byte_timeout_s,
            settings.upstream_read_timeout_s,
        ),
        guard=guard,
        integrity_interval_s=settings.integrity_interval_s,
        cluster=cluster,
        health=HealthConfig(settings.health_check_interval, settings.health_check_timeout,
                            settings.health_check_failures, answer_s),
    )  # fmt: skip
    if cluster is not None and peer_sock is not None:
        serve_peers(platform, cluster, peer_sock)
    platform.gateway.max_sequences_per_request = settings.max_sequences_per_request
    platform.gateway.direct_streams = settings.direct_streams
    if settings.api_key is not None:
        platform.keyring.add_fixed(settings.api_key, "--api-key / KUNLUN_API_KEY")
    platform.allowed_origins = settings.origins()
    return platform


def join_cluster(settings: DaemonSettings) -> tuple[ClusterConfig | None, socket.socket | None]:
    """With ``--cluster-etcd``: the cluster's config and the bound peer port; without, none,
    and a cluster option given alone is a :class:`ConfigError`."""
    if settings.cluster_etcd is None:
        if (settings.node_name or settings.cluster_certs or settings.advertise_url
                or settings.insecure_cluster or settings.cluster_files):  # fmt: skip
            raise ConfigError(
                "cluster options need --cluster-etcd", location=Location("--cluster-etcd")
            )
        return None, None
    from kunlun.cluster import member

    peer_port = settings.peer_port or settings.port + 1
    cluster = member.cluster_config(
        settings.cluster_etcd, settings.node_name, settings.host, settings.port, peer_port,
        settings.advertise_url, settings.cluster_certs, settings.insecure_cluster,
        settings.cluster_lease_ttl_s, settings.cluster_files,
    )  # fmt: skip
    return cluster, bind_socket(settings.host, peer_port)


def serve_peers(platform: Platform, cluster: ClusterConfig, peer_sock: socket.socket) -> None:
    """The peer port other nodes relay requests to, over ``platform``'s replicas."""
    from kunlun.cluster.peer import PeerApp, PeerServer

    context = None if cluster.tls is None else cluster.tls.server_context()
    peer_app = PeerApp(cluster.node_name, platform.replicas)
    platform.peer = PeerServer(peer_app, peer_sock, context)
    if platform.cluster is not None:
        platform.cluster.local.peer_in_flight = lambda rid: peer_app.in_flight.get(rid, 0)


def bind(settings: DaemonSettings, platform: Platform) -> tuple[socket.socket, tuple[str, ...]]:
    """The bound socket (listening once the pid file is written) and the proxies believed;
    the last refusals first: a bad
    ``--forwarded-allow-ips``, ``KUNLUN_BUDGET_*`` or ``KUNLUN_UI_SAMPLE_S``, a non-loopback
    bind with no API key."""
    from kunlun.ui.history import interval_from_env as ui_history_interval

    proxies = settings.proxies()
    budgets.check()  # a bad KUNLUN_BUDGET_* stops the start here, named
    ui_history_interval()  # so does a bad KUNLUN_UI_SAMPLE_S (the dashboard's sampling)
    host = settings.host
    if not _is_loopback(host) and not platform.keyring.enabled and not settings.allow_insecure:
        raise DaemonError(
            f"refusing to listen on {host} with no API key configured",
            location=Location("--host"),
            hint="kunlun-cli apikey create NAME first, or pass --allow-insecure",
        )
    return bind_socket(host, settings.port, listen=False), proxies


def run(
    settings: DaemonSettings,
    platform: Platform,
    sock: socket.socket,
    proxies: tuple[str, ...],
) -> None:
    """Serve ``platform`` on ``sock`` until SIGTERM has drained it; exits 0."""
    import uvicorn

    from kunlun.daemon.app import create_asgi
    from kunlun.daemon.drain import DrainingServer
    from kunlun.serving.handoff import ClientSocketScope

    server = DrainingServer(
        uvicorn.Config(
            ClientSocketScope(create_asgi(platform)),
            log_level="warning",
            lifespan="on",  # a start-up that fails stops the daemon (auto: it served on, idle)
            timeout_graceful_shutdown=30,
            proxy_headers=bool(proxies),
            forwarded_allow_ips=list(proxies) or None,
        ),
        platform,
    )
    console.print(
        f"Kunlun Platform listening on http://{settings.host}:{settings.port} "
        f"(KUNLUN_HOME={kunlun_home()})"
    )
    server.run(sockets=[sock])
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


def _serve_at_start(platform: Platform, source: str, fields: dict[str, Any]) -> None:
    """``--model``: resolve ``source`` (:func:`kunlun.catalog.model_source`) and submit a
    workload for it with ``fields`` (:meth:`DaemonSettings.served_fields`), unless one of
    that name is already active."""
    from kunlun import catalog
    from kunlun.workload.chat_template import read_chat_template

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


def _ensure_demo(platform: Platform) -> None:
    from kunlun import catalog

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
