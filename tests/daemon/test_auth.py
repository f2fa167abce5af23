"""API keys on a real daemon (no workload: the keys guard the routes, not a model): every
route but /healthz, /readyz and /health needs one; bind rules; a fixed key from the
environment."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
from tests import loopback
from tests.daemons import Daemon, Daemons, Profile, daemon_fixture, refused

OPEN = {"/healthz", "/readyz", "/health", "/ping"}  # (/ping: vLLM's health answer)


auth_daemon = daemon_fixture(Profile("auth-home", keys=(("ops", "admin"),)))
"""A daemon with no workload and one admin key ``ops``, made directly on KUNLUN_HOME."""


@pytest.fixture(scope="module")
def keyed(auth_daemon: Daemon) -> tuple[Daemon, str]:
    key = auth_daemon.keys["ops"]
    for stored in auth_daemon.home.glob("state.db*"):  # the database and its journal files
        assert key not in stored.read_bytes().decode("latin-1")  # only a hash is stored
    return auth_daemon, key


def route_table(tmp_path: Path) -> list[tuple[str, str]]:
    """(method, path) of every route of the daemon's app, parameters filled in: the API
    routes from the app's OpenAPI schema, plus the plain routes (docs, schema) it serves."""
    from kunlun.daemon.app import create_app, make_platform

    app = create_app(make_platform(tmp_path))
    routes = [
        (method.upper(), path) for path, item in app.openapi()["paths"].items() for method in item
    ]
    routes += [
        ("GET", r.path)
        for r in app.routes
        if getattr(r, "path", "") and not getattr(r, "include_in_schema", True)
    ]
    return [(m, re.sub(r"\{[^}]+\}", "x", p)) for m, p in routes]


def test_every_route_but_health_needs_a_key(keyed: tuple[Daemon, str], tmp_path: Path) -> None:
    daemon, key = keyed
    routes = route_table(tmp_path)
    paths = {p for _, p in routes}
    assert {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/api/v1/workloads",
        "/openapi.json",
    } <= paths
    for method, path in routes:
        for headers in (
            {},
            {"Authorization": "Bearer kl-wrong-key"},
            {"Authorization": f"Bearer {key}x"},
        ):
            resp = loopback.request(method, daemon.url + path, headers=headers, json={}, timeout=30)
            if path in OPEN:
                assert resp.status_code != 401, (method, path)
            else:
                assert resp.status_code == 401, (method, path, headers, resp.status_code)
                assert resp.json()["error"]["code"] == "invalid_api_key"
    ok = loopback.get(daemon.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert ok.status_code == 200


def test_every_admin_route_needs_an_admin_key(keyed: tuple[Daemon, str], tmp_path: Path) -> None:
    """Every route under /api/v1 is 403 with an inference key, naming the scope it needs;
    every other route is not refused for the key's scope."""
    daemon, key = keyed
    made = daemon.cli("apikey", "create", "reader", "--json", key=key)  # default scope
    assert made.returncode == 0, made.stderr
    reader = json.loads(made.stdout)
    assert reader["scope"] == "inference"
    headers = {"Authorization": f"Bearer {reader['key']}"}
    routes = route_table(tmp_path)
    admin = [(m, p) for m, p in routes if p.startswith("/api/v1/")]
    assert {("POST", "/api/v1/apikeys"), ("DELETE", "/api/v1/apikeys/x"),
            ("POST", "/api/v1/workloads"), ("POST", "/api/v1/models/import-gguf"),
            ("GET", "/api/v1/devices")} <= set(admin)  # fmt: skip
    for method, path in routes:
        resp = loopback.request(method, daemon.url + path, headers=headers, json={}, timeout=30)
        if (method, path) in admin:
            assert resp.status_code == 403, (method, path, resp.status_code)
            error = resp.json()["error"]
            assert error["code"] == "permission_denied" and error["type"] == "permission_error"
            assert "needs an API key with scope 'admin'" in error["message"]
            assert "'reader'" in error["message"] and reader["key"] not in error["message"]
        else:
            assert resp.status_code not in (401, 403), (method, path, resp.status_code)
    assert daemon.cli("apikey", "revoke", "reader", key=key).returncode == 0


def test_openai_sdk_with_wrong_key_gets_401(keyed: tuple[Daemon, str]) -> None:
    daemon, key = keyed
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=daemon.url + "/v1", api_key="nope", max_retries=0).models.list()
    models = openai.OpenAI(base_url=daemon.url + "/v1", api_key=key, max_retries=0).models.list()
    assert models.data == []  # no workload in this daemon


def test_apikey_cli_through_the_daemon(keyed: tuple[Daemon, str]) -> None:
    daemon, key = keyed
    denied = daemon.cli("apikey", "list")
    assert denied.returncode == 1 and "401" in denied.stderr and "KUNLUN_API_KEY" in denied.stderr
    made = daemon.cli("apikey", "create", "ci", "--json", key=key)
    assert made.returncode == 0, made.stderr
    second = json.loads(made.stdout)
    listed = daemon.cli("apikey", "list", "--json", key=key)
    names = {k["name"]: k for k in json.loads(listed.stdout)}
    assert {"ops", "ci"} <= set(names) and "key" not in names["ci"]
    assert (
        loopback.get(
            daemon.url + "/v1/models", headers={"Authorization": f"Bearer {second['key']}"}
        ).status_code
        == 200
    )
    revoked = daemon.cli("apikey", "revoke", "ci", key=key)
    assert revoked.returncode == 0 and second["key_id"] in revoked.stdout
    assert (
        loopback.get(
            daemon.url + "/v1/models", headers={"Authorization": f"Bearer {second['key']}"}
        ).status_code
        == 401
    )
    missing = daemon.cli("apikey", "revoke", "nobody", key=key)
    assert missing.returncode == 2 and "nobody" in missing.stderr


def test_key_revoked_on_disk_takes_effect_in_the_running_daemon(keyed: tuple[Daemon, str]) -> None:
    daemon, key = keyed
    made = daemon.cli("apikey", "create", "temp", "--json", remote=False)
    temp = json.loads(made.stdout)["key"]
    assert (
        loopback.get(
            daemon.url + "/v1/models", headers={"Authorization": f"Bearer {temp}"}
        ).status_code
        == 200
    )
    assert daemon.cli("apikey", "revoke", "temp", remote=False).returncode == 0
    deadline = time.monotonic() + 30  # the daemon rereads its keys at most every 0.25 s
    while (status := daemon.get("/v1/models", headers={"Authorization": f"Bearer {temp}"})
           .status_code) == 200:  # fmt: skip
        assert time.monotonic() < deadline, "the revoked key was still accepted"
        time.sleep(0.1)
    assert status == 401


def test_non_loopback_bind_without_key_is_refused(tmp_path: Path) -> None:
    proc = refused(tmp_path, "--host", "0.0.0.0")
    assert proc.returncode == 2
    assert "refusing to listen on 0.0.0.0 with no API key" in proc.stderr
    assert "--allow-insecure" in proc.stderr


def test_port_in_use_names_the_port_and_holder(keyed: tuple[Daemon, str], tmp_path: Path) -> None:
    daemon, _ = keyed
    proc = refused(tmp_path, port=daemon.port)
    assert proc.returncode == 2
    assert f"port {daemon.port} on 127.0.0.1 is already in use by" in proc.stderr
    assert "kunlun-platform" in proc.stderr or "python" in proc.stderr
    again = refused(daemon.home)
    assert again.returncode == 2 and "a daemon already runs" in again.stderr


def test_a_fixed_key_from_the_environment_is_an_admin_key_not_stored(daemons: Daemons) -> None:
    secret = "ci-fixed-key-0123"
    with daemons.serve(Profile("fixed-key-home", env=(("KUNLUN_API_KEY", secret),))) as daemon:
        assert daemon.get("/v1/models").status_code == 401
        wrong = daemon.get("/v1/models", headers={"Authorization": "Bearer ci-fixed-key-0124"})
        assert wrong.status_code == 401
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key=secret, max_retries=0)
        assert client.models.list().data == []
        admin = daemon.get("/api/v1/workloads", headers={"Authorization": f"Bearer {secret}"})
        assert admin.status_code == 200 and admin.json() == []
        assert daemon.get("/health").status_code == 503  # open: no replica is ready
    assert secret not in (daemon.home / "state.db").read_bytes().decode("latin-1")
    short = refused(daemon.home, env={"KUNLUN_API_KEY": "short"})
    assert short.returncode == 2, short.stdout + short.stderr
    assert "KUNLUN_API_KEY" in short.stderr and "too short" in short.stderr


def test_cors_only_for_the_allowed_origins(daemons: Daemons) -> None:
    secret, app = "cors-test-key-42", "https://app.example.com"
    origins = ("--allowed-origins", f"{app},http://localhost:3000")
    cors = Profile("cors-home", args=origins, env=(("KUNLUN_API_KEY", secret),))
    with daemons.serve(cors) as daemon:
        preflight = httpx.options(daemon.url + "/v1/chat/completions", timeout=30, headers={
            "Origin": app, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})  # fmt: skip
        assert preflight.status_code == 200, preflight.text  # answered without a key
        assert preflight.headers["access-control-allow-origin"] == app
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        listed = daemon.get(
            "/v1/models", headers={"Origin": app, "Authorization": f"Bearer {secret}"}
        )
        assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == app
        assert "x-request-id" in listed.headers["access-control-expose-headers"].lower()
        keyless = daemon.get("/v1/models", headers={"Origin": app})
        assert keyless.status_code == 401  # CORS lets the browser read the answer, not skip keys
        other = daemon.get("/v1/models", headers={"Origin": "https://evil.example",
                                                  "Authorization": f"Bearer {secret}"})  # fmt: skip
        assert "access-control-allow-origin" not in other.headers
    bad = refused(daemon.home, "--allowed-origins", "app.example.com/path")
    assert bad.returncode == 2 and "--allowed-origins" in bad.stderr, bad.stdout + bad.stderr
    assert "'app.example.com/path' is not an origin" in bad.stderr


def test_no_cors_headers_without_allowed_origins(keyed: tuple[Daemon, str]) -> None:
    daemon, key = keyed
    answer = daemon.get("/v1/models", headers={"Origin": "https://app.example.com",
                                               "Authorization": f"Bearer {key}"})  # fmt: skip
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers
