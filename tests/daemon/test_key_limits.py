"""Key scopes, per-key limits and model roots on a real daemon, with httpx and the openai SDK.

One daemon serves the tiny model. Its ``scheduler_config.yaml`` gives every key without an
allow-list of its own the network 10.0.0.0/8, which excludes loopback, so a key made here
without ``--allow-ip`` cannot be used from the test; the other keys allow 127.0.0.1.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests import loopback
from tests.daemons import TINY, Daemon, Daemons, Profile, refused

LOOPBACK = "127.0.0.1/32,::1"


@dataclass
class Limited:
    daemon: Daemon
    keys: dict[str, str]
    roots: dict[str, Path]

    def headers(self, name: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[name]}"}

    def get(self, path: str, key: str) -> httpx.Response:
        return loopback.get(self.daemon.url + path, headers=self.headers(key), timeout=60)

    def post(self, path: str, key: str, body: dict[str, Any]) -> httpx.Response:
        url = self.daemon.url + path
        return loopback.post(url, headers=self.headers(key), json=body, timeout=300)

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.daemon.url + "/v1", api_key=self.keys[key],
                             max_retries=0, timeout=300)  # fmt: skip


@pytest.fixture(scope="module")
def limited(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Limited]:
    roots = {name: tmp_path_factory.mktemp(f"root-{name}") for name in ("flag", "env", "config")}
    profile = Profile(
        "limits-home", (TINY,), args=("--model-root", str(roots["flag"])),
        # keys with options of their own, made on the home (``ops`` first: it submits)
        keys=(
            ("ops", "admin", "--allow-ip", LOOPBACK),
            ("app", "inference", "--allow-ip", LOOPBACK),
            ("fenced", "inference"),  # the daemon's default allow-list: 10.0.0.0/8
            ("elsewhere", "inference", "--allow-ip", "192.168.0.0/16"),
            ("burst", "inference", "--rpm", "60", "--allow-ip", LOOPBACK),
            ("frugal", "inference", "--tpm", "600", "--allow-ip", LOOPBACK),
            ("refunded", "inference", "--tpm", "1200", "--allow-ip", LOOPBACK),
        ),
        env=(("KUNLUN_MODEL_ROOTS", str(roots["env"])),),
        files=(("scheduler_config.yaml", "api_keys: {allow_ips: [10.0.0.0/8]}\n"
                f"model_roots: [{roots['config']}]\n"),),
    )  # fmt: skip
    with Daemons(request).serve(profile) as d:
        yield Limited(d, d.keys, roots)


def chat(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": max_tokens, "temperature": 0, **extra}  # fmt: skip


def counter(text: str, name: str, **labels: str) -> float:
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


def test_inference_key_is_refused_on_admin_routes_and_served_on_v1(limited: Limited) -> None:
    for method, path in (("GET", "/api/v1/workloads"), ("POST", "/api/v1/apikeys"),
                         ("GET", "/api/v1/devices"), ("POST", "/api/v1/models/import-gguf")):  # fmt: skip
        resp = loopback.request(method, limited.daemon.url + path, headers=limited.headers("app"),
                             json={"name": "sneaky", "path": "/etc/passwd"})  # fmt: skip
        assert resp.status_code == 403, (method, path, resp.text)
        error = resp.json()["error"]
        assert error["type"] == "permission_error" and error["code"] == "permission_denied"
        assert "scope 'admin'" in error["message"] and "'inference'" in error["message"]
    names = [k["name"] for k in limited.get("/api/v1/apikeys", "ops").json()]
    assert "sneaky" not in names  # the refused create did nothing
    app = limited.client("app")
    assert [m.id for m in app.models.list().data] == ["tiny"]
    reply = app.chat.completions.create(**chat(4))
    assert reply.choices[0].message.content
    admin_api = openai.OpenAI(base_url=limited.daemon.url + "/api/v1",
                              api_key=limited.keys["app"], max_retries=0)  # fmt: skip
    with pytest.raises(openai.PermissionDeniedError):
        admin_api.get("/workloads", cast_to=object)
    denied = limited.daemon.cli("apikey", "create", "x", key=limited.keys["app"])
    assert denied.returncode == 1 and "403" in denied.stderr and "scope 'admin'" in denied.stderr


def test_admin_key_lists_scopes_and_limits_and_creates_keys(limited: Limited) -> None:
    listed = limited.daemon.cli("apikey", "list", "--json", key=limited.keys["ops"])
    assert listed.returncode == 0, listed.stderr
    by_name = {k["name"]: k for k in json.loads(listed.stdout)}
    assert by_name["ops"]["scope"] == "admin" and by_name["app"]["scope"] == "inference"
    assert by_name["burst"]["rpm"] == 60 and by_name["frugal"]["tpm"] == 600
    assert by_name["app"]["allow_ips"] == ["127.0.0.1/32", "::1/128"]
    assert by_name["fenced"]["allow_ips"] is None
    table = limited.daemon.cli("apikey", "list", key=limited.keys["ops"])
    assert "SCOPE" in table.stdout and "admin" in table.stdout and "inference" in table.stdout
    body = {"name": "api-made", "scope": "inference", "rpm": 5, "tpm": 500,
            "allow_ips": ["127.0.0.1"]}  # fmt: skip
    made = limited.post("/api/v1/apikeys", "ops", body)
    assert made.status_code == 200, made.text
    assert {k: made.json()[k] for k in body} == {**body, "allow_ips": ["127.0.0.1/32"]}
    new = {"Authorization": f"Bearer {made.json()['key']}"}
    assert loopback.get(limited.daemon.url + "/v1/models", headers=new).status_code == 200
    for bad, field in (({"name": "b", "rpm": "many"}, "rpm"),
                       ({"name": "b", "allow_ips": ["300.1.1.1"]}, "allow_ips"),
                       ({"name": "b", "scope": "root"}, "scope"),
                       ({"name": "b", "colour": "red"}, "colour")):  # fmt: skip
        refused = limited.post("/api/v1/apikeys", "ops", bad)
        assert refused.status_code == 400, (bad, refused.text)
        assert field in refused.json()["error"]["message"]


def test_allow_list_refuses_other_addresses_naming_the_ip(limited: Limited) -> None:
    for name in ("fenced", "elsewhere"):
        resp = limited.get("/v1/models", name)
        assert resp.status_code == 403, resp.text
        error = resp.json()["error"]
        assert "127.0.0.1" in error["message"] and f"'{name}'" in error["message"]
        assert error["code"] == "permission_denied"
        with pytest.raises(openai.PermissionDeniedError):
            limited.client(name).models.list()
    assert limited.get("/v1/models", "app").status_code == 200  # 127.0.0.1 is in its list
    text = limited.get("/metrics", "ops").text
    assert counter(text, "kunlun_api_key_denied_requests_total", key="fenced", reason="ip") >= 2


def forwarded(daemon: Daemon, key: str, client: str | None) -> httpx.Response:
    """``GET /v1/models`` with ``key``, saying it is from ``client`` (``X-Forwarded-For``)."""
    headers = {"Authorization": f"Bearer {key}"}
    if client is not None:
        headers["X-Forwarded-For"] = client
    return daemon.get("/v1/models", headers=headers)


def test_x_forwarded_for_counts_only_from_the_proxies_named(
    limited: Limited, daemons: Daemons
) -> None:
    """A client cannot pick its address by a header: the daemon believes ``X-Forwarded-For``
    only from ``--forwarded-allow-ips`` (none by default), and then only that header."""
    refused_anyway = forwarded(limited.daemon, limited.keys["fenced"], "10.9.9.5")
    assert refused_anyway.status_code == 403, refused_anyway.text  # 10.0.0.0/8, from 127.0.0.1
    assert "127.0.0.1" in refused_anyway.json()["error"]["message"]
    behind = Profile("proxied-home", args=("--forwarded-allow-ips", "127.0.0.1/32"),
                     keys=(("lan", "inference", "--allow-ip", "10.9.9.0/24"),))  # fmt: skip
    with daemons.serve(behind) as daemon:
        lan = daemon.keys["lan"]
        assert forwarded(daemon, lan, "10.9.9.5").status_code == 200  # the proxy says so
        outside = forwarded(daemon, lan, "10.9.8.5")
        assert outside.status_code == 403 and "10.9.8.5" in outside.json()["error"]["message"]
        assert forwarded(daemon, lan, None).status_code == 403  # the proxy itself
        assert_wrong_keys_are_throttled_per_address(daemon, lan)


def assert_wrong_keys_are_throttled_per_address(daemon: Daemon, lan: str) -> None:
    """Issue 32's weak points: wrong keys from one address (here told by the named proxy)
    are answered 429 with ``Retry-After`` past FAILED_KEYS_PER_MINUTE a minute, at the API
    and the dashboard's login alike, while a valid key from that address and wrong keys from
    other addresses are answered as before; two credentials in one request are refused."""
    from kunlun.state.api_keys import FAILED_KEYS_PER_MINUTE

    guesser = "10.9.9.7"
    for _ in range(FAILED_KEYS_PER_MINUTE):
        assert forwarded(daemon, "kl-guess", guesser).status_code == 401
    throttled = forwarded(daemon, "kl-guess", guesser)
    assert throttled.status_code == 429 and int(throttled.headers["retry-after"]) >= 1
    assert guesser in throttled.json()["error"]["message"]
    login = loopback.post(daemon.url + "/ui/login", data={"key": "kl-guess"}, timeout=30,
                       headers={"X-Forwarded-For": guesser}, follow_redirects=False)  # fmt: skip
    assert login.status_code == 429 and "too many wrong keys" in login.text
    assert forwarded(daemon, lan, guesser).status_code == 200  # its own valid key passes
    assert forwarded(daemon, "kl-guess", "10.9.9.8").status_code == 401  # another address
    both = daemon.get("/v1/models", headers={"Authorization": f"Bearer {lan}", "X-API-Key": lan,
                                             "X-Forwarded-For": "10.9.9.5"})  # fmt: skip
    assert both.status_code == 400, both.text
    assert "2 credentials" in both.json()["error"]["message"]


def test_a_bad_proxy_address_stops_the_start_naming_it(tmp_path: Path) -> None:
    proc = refused(tmp_path / "home", "--forwarded-allow-ips", "127.0.0.1,proxy.example")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--forwarded-allow-ips" in proc.stderr and "'proxy.example'" in proc.stderr


def test_rpm_gives_429_with_retry_after_then_serves_again(limited: Limited) -> None:
    refused = None
    for _ in range(2000):  # a burst of 60, refilled at one a second
        resp = limited.get("/v1/models", "burst")
        if resp.status_code == 429:
            refused = resp
            break
        assert resp.status_code == 200, resp.text
    assert refused is not None, "60 requests per minute were never refused"
    assert int(refused.headers["Retry-After"]) >= 1
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert "'burst'" in error["message"] and "60 requests per minute" in error["message"]
    # the SDK sees the same refusal: the bucket refills one a second, so on a slow machine a
    # token may come back between two requests; the next one after it is refused again
    client, sdk_refused = limited.client("burst"), None
    for _ in range(100):
        try:
            client.models.list()
        except openai.RateLimitError as exc:
            sdk_refused = exc
            break
    assert sdk_refused is not None and "60 requests per minute" in sdk_refused.message
    deadline = time.monotonic() + 120
    while limited.get("/v1/models", "burst").status_code == 429:
        assert time.monotonic() < deadline, "the rpm limit did not free up"
        time.sleep(0.2)  # a refused request takes nothing from the bucket
    assert limited.get("/v1/models", "app").status_code == 200  # other keys were never limited
    text = limited.get("/metrics", "ops").text
    assert counter(text, "kunlun_rate_limited_requests_total", key="burst", limit="rpm") >= 2
    for secret in limited.keys.values():
        assert secret not in text


def test_tpm_gives_429_once_the_minutes_tokens_are_used(limited: Limited) -> None:
    frugal = limited.client("frugal")
    refused = None
    # each answer uses some 60 tokens; the bucket refills ten a second, so once refused the
    # next small request is served again within seconds
    for _ in range(40):
        try:
            frugal.chat.completions.create(**chat(48, extra_body={"ignore_eos": True}))
        except openai.RateLimitError as exc:
            refused = exc
            break
    assert refused is not None, "600 tokens per minute were never refused"
    assert int(refused.response.headers["Retry-After"]) >= 1
    assert "600 tokens per minute" in refused.message and "'frugal'" in refused.message
    deadline = time.monotonic() + 180
    while True:
        resp = limited.post("/v1/chat/completions", "frugal", chat(1))
        if resp.status_code == 200:
            break
        assert resp.status_code == 429 and time.monotonic() < deadline, resp.text
        assert int(resp.headers["Retry-After"]) >= 1
        time.sleep(0.2)  # a refused request takes nothing from the bucket
    text = limited.get("/metrics", "ops").text
    assert counter(text, "kunlun_rate_limited_requests_total", key="frugal", limit="tpm") >= 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tpm_charge_is_corrected_to_the_usage(limited: Limited, stream: bool) -> None:
    """1,200 tokens a minute; each request is estimated at over 1,000 (its max_tokens) but
    stops at the first space: kept at the estimate, the third would be refused. A stream's
    usage is read off its end as it passes the gateway (such a stream is never direct)."""
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    for _ in range(3):
        resp = limited.post("/v1/completions", "refunded", {
            "model": "tiny", "prompt": "Once upon a time", "max_tokens": 1000,
            "temperature": 0, "stop": [" ", "\n", ","], **extra})  # fmt: skip
        assert resp.status_code == 200, resp.text
        if stream:
            events = [e.removeprefix("data: ") for e in resp.text.split("\n\n") if e]
            assert events[-1] == "[DONE]"
            usage = json.loads(events[-2])["usage"]
        else:
            usage = resp.json()["usage"]
        assert usage["total_tokens"] < 50


def import_gguf(limited: Limited, path: str | Path) -> httpx.Response:
    return limited.post("/api/v1/models/import-gguf", "ops", {"path": str(path)})


def test_import_outside_the_model_roots_is_refused_alike_for_existing_and_missing(
    limited: Limited, tmp_path: Path
) -> None:
    outside = tmp_path / "secret.gguf"
    outside.write_bytes(b"GGUF" + b"\0" * 60)
    link = limited.roots["flag"] / "link.gguf"
    link.symlink_to(outside)
    dotdot = limited.roots["flag"] / ".." / tmp_path.name / "secret.gguf"
    messages = {}
    for path in (outside, tmp_path / "missing.gguf", "/etc/passwd", "/etc/nothing-here",
                 link, dotdot):  # fmt: skip
        resp = import_gguf(limited, path)
        assert resp.status_code == 403, (path, resp.text)
        message = resp.json()["error"]["message"]
        assert str(limited.roots["flag"]) in message and str(limited.roots["env"]) in message
        messages[str(path)] = message.replace(repr(str(path)), "PATH")
    assert len(set(messages.values())) == 1, messages
    cli = limited.daemon.cli("model", "import-gguf", "/etc/passwd", key=limited.keys["ops"])
    assert cli.returncode != 0 and "outside the model roots" in cli.stderr


def test_import_inside_every_kind_of_model_root_is_read(limited: Limited) -> None:
    for kind, root in limited.roots.items():
        garbage = root / f"{kind}.gguf"
        garbage.write_bytes(b"not a gguf file at all")
        resp = import_gguf(limited, garbage)
        assert resp.status_code == 400, (kind, resp.text)  # read, and found not to be GGUF
        missing = import_gguf(limited, root / "absent.gguf")
        assert missing.status_code == 400 and "not found" in missing.json()["error"]["message"]


def test_a_model_root_that_is_not_a_directory_stops_the_start(tmp_path: Path) -> None:
    home = tmp_path / "home"
    for args, env, named in (
        (["--model-root", str(tmp_path / "nowhere")], {}, "--model-root"),
        ([], {"KUNLUN_MODEL_ROOTS": f"{tmp_path}:{tmp_path / 'gone'}"}, "KUNLUN_MODEL_ROOTS"),
    ):
        proc = refused(home, *args, env=env)
        assert proc.returncode == 2, proc.stderr
        assert named in proc.stderr and "is not a directory" in proc.stderr
