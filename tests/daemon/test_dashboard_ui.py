"""The ``/ui`` dashboard in a real browser (Debian's chromium through Playwright) against a
real daemon with API keys serving the tiny model: login and sessions, Devices, Workloads
(submit and stop from the page), a streamed Playground reply, scopes, escaping, and no
request leaving the daemon. Screenshots of every page are taken (``SHOTS``)."""

from __future__ import annotations

import os
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from tests.daemons import TINY, Daemon, Profile, daemon_fixture

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = Path("/usr/bin/chromium")
SHOTS = Path(os.environ.get("KUNLUN_DASHBOARD_SHOTS") or tempfile.mkdtemp(prefix="dashboard-"))
"""Where the pages' screenshots go: a temporary folder, or ``KUNLUN_DASHBOARD_SHOTS``. The
pictures in ``docs/dashboard/`` show the demo model and are not overwritten by a test run,
whose daemons serve the tiny model."""
HOSTILE = "<img src=x onerror=alert(1)>"
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium")


ui_daemon = daemon_fixture(
    Profile("ui-home", (TINY,), keys=(("ops", "admin"), ("reader", "inference")))
)
"""A daemon with an admin and an inference key, serving the tiny model as ``tiny``."""


@pytest.fixture(scope="module")
def keyed(ui_daemon: Daemon) -> tuple[Daemon, str, str]:
    return ui_daemon, ui_daemon.keys["ops"], ui_daemon.keys["reader"]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as play:
        chromium = play.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        yield chromium
        chromium.close()


class Watch:
    """Every URL a page requests and every dialog it opens."""

    def __init__(self, page: Any) -> None:
        self.urls: list[str] = []
        self.dialogs: list[str] = []
        page.on("request", lambda r: self.urls.append(r.url))
        page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))

    def assert_local(self, daemon: Daemon) -> None:
        outside = [u for u in self.urls if not u.startswith(daemon.url + "/")]
        assert self.urls and not outside, outside
        assert not self.dialogs


def login(browser: Any, daemon: Daemon, key: str) -> tuple[Any, Any, Watch]:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    watch = Watch(page)
    page.goto(daemon.url + "/ui/login")
    page.fill("input[name=key]", key)
    page.click("button[type=submit]")
    page.wait_for_url("**/ui/devices")
    return context, page, watch


def shot(page: Any, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def test_no_session_redirects_and_a_wrong_key_is_refused(keyed: Any, browser: Any) -> None:
    daemon, admin, _ = keyed
    context = browser.new_context()
    page = context.new_page()
    watch = Watch(page)
    for path in ("/ui/devices", "/ui/workloads", "/ui/playground", "/ui"):
        page.goto(daemon.url + path)
        assert page.url == daemon.url + "/ui/login"
    shot(page, "login")
    page.fill("input[name=key]", "kl-not-a-real-key")
    with page.expect_response("**/ui/login") as answer:
        page.click("button[type=submit]")
    assert answer.value.status == 401
    assert "not an active API key" in page.text_content("#error")
    page.fill("input[name=key]", "")
    page.click("button[type=submit]")
    assert page.text_content("#error").startswith("key:")  # names the field
    forged = f"x.{int(time.time()) + 3600}.{'0' * 64}"
    context.add_cookies([{"name": "kunlun_ui", "value": forged, "url": daemon.url + "/ui"}])
    page.goto(daemon.url + "/ui/devices")
    assert page.url.endswith("/ui/login")
    called = page.request.get(daemon.url + "/ui/call/v1/models")
    assert called.status == 401
    watch.assert_local(daemon)
    context.close()


def test_admin_sees_devices_submits_a_workload_and_stops_it(
    keyed: Any, browser: Any, tiny_model: Path
) -> None:
    daemon, admin, _ = keyed
    context, page, watch = login(browser, daemon, admin)
    (cookie,) = context.cookies()
    assert (cookie["name"], cookie["httpOnly"], cookie["sameSite"]) == ("kunlun_ui", True, "Strict")
    assert 7.9 * 3600 < cookie["expires"] - time.time() <= 8 * 3600
    assert admin not in cookie["value"]  # the key stays on the daemon
    assert stat.S_IMODE(os.stat(daemon.home / "ui-secret").st_mode) == 0o600
    assert page.evaluate("document.cookie") == ""  # HttpOnly: no script reads it
    for path in ("/ui/call/api/v1/apikeys", "/ui/call/v1/../api/v1/apikeys"):
        refused = page.request.get(daemon.url + path)  # only /v1 and /metrics pass through
        assert refused.status == 403 and "apikeys" in refused.text()
    row = page.locator("tr[data-device='cpu:0']")
    assert row.locator(".status").text_content().split()[0] == "Ready"
    assert "MiB" in row.text_content() and "memory_total_mb" in row.text_content()
    shot(page, "devices")

    page.goto(daemon.url + "/ui/workloads")
    for field, value, error in (("max_num_seqs", "many", "max_num_seqs"), ("name", HOSTILE, "name"),
                                ("model", HOSTILE, "model")):  # fmt: skip
        page.fill("#submit input[name=model]", str(tiny_model))
        page.fill("#submit input[name=name]", "second")
        page.fill("#submit input[name=max_num_seqs]", "2")
        page.fill(f"#submit input[name={field}]", value)
        page.click("#submit button[type=submit]")
        message = page.text_content("#form-error")
        assert error in message and value in message, message  # the value shown as text
        assert page.locator("img").count() == 0
    page.fill("#submit input[name=model]", str(tiny_model))
    page.fill("#submit input[name=name]", "second")
    page.fill("#submit input[name=max_num_seqs]", "2")
    page.fill("#submit input[name=max_model_len]", "256")
    page.fill("#submit input[name=kv_cache_memory_mb]", "32")
    page.click("#submit button[type=submit]")
    page.wait_for_url("**/ui/workloads/*")
    deadline = time.monotonic() + 300
    while page.text_content("#state") != "RUNNING":
        assert page.text_content("#state") not in ("FAILED", "STOPPED"), page.content()
        assert time.monotonic() < deadline, page.content()
        time.sleep(0.25)
        page.reload()
    assert "cpu:0" in page.text_content("#why") or page.text_content("#why")
    assert page.locator("#events tr").count() > 1
    shot(page, "workload")
    page.goto(daemon.url + "/ui/workloads")
    second = page.locator("tr[data-name=second]")
    assert second.locator(".state").text_content() == "RUNNING"
    shot(page, "workloads")
    second.locator("button.stop").click()
    page.wait_for_url("**/ui/workloads")
    assert page.locator("tr[data-name=second] .state").text_content() in ("STOPPING", "STOPPED")
    watch.assert_local(daemon)
    page.click("#logout")
    page.goto(daemon.url + "/ui/devices")
    assert page.url.endswith("/ui/login")
    context.close()


def models_listed(page: Any) -> None:
    """Wait until the playground has listed the served models. A locator's wait, not
    ``wait_for_function``: that polls by eval inside the page, which the dashboard's CSP
    forbids (it passed only when the list was already there at the first look)."""
    page.locator("#model option").first.wait_for(state="attached", timeout=60_000)


def test_playground_streams_a_reply_and_shows_the_request(keyed: Any, browser: Any) -> None:
    daemon, admin, _ = keyed
    context, page, watch = login(browser, daemon, admin)
    page.goto(daemon.url + "/ui/playground")
    models_listed(page)
    assert page.input_value("#model") == "tiny"
    page.fill("#max_tokens", "64")
    page.fill("#temperature", "0")
    page.fill("#prompt", f"Say hello. {HOSTILE}")
    page.evaluate(
        """() => { window.seen = [];
        new MutationObserver(() => { const r = document.querySelector('.msg.assistant');
          if (r) window.seen.push(r.textContent.length); })
        .observe(document.getElementById('transcript'), {subtree: true, childList: true,
                                                         characterData: true}); }"""
    )
    page.click("#send")
    page.wait_for_selector(".msg.assistant[data-done='1']", timeout=120_000)
    reply = page.locator(".msg.assistant")
    assert reply.text_content().strip(), page.text_content("#chat-error")
    assert int(reply.get_attribute("data-chunks")) > 1
    growth = sorted(set(page.evaluate("window.seen")))
    assert len([n for n in growth if n > 0]) >= 2, growth  # drawn chunk by chunk
    assert page.text_content(".msg.user") == f"Say hello. {HOSTILE}"  # literal text
    assert page.locator("img").count() == 0
    curl, python = page.text_content("#curl"), page.text_content("#python")
    assert daemon.url + "/v1/chat/completions" in curl and '"max_tokens": 64' in curl
    assert 'model="tiny"' in python and "stream=True" in python
    shot(page, "playground")
    watch.assert_local(daemon)
    context.close()


def test_an_inference_key_sees_no_submit_or_stop(keyed: Any, browser: Any) -> None:
    daemon, _, reader = keyed
    context, page, watch = login(browser, daemon, reader)
    assert "scope 'admin'" in page.text_content("main")  # the admin API's own refusal
    page.goto(daemon.url + "/ui/workloads")
    assert page.locator("#submit").count() == 0 and page.locator("button.stop").count() == 0
    posted = page.request.post(daemon.url + "/ui/workloads", form={"model": "tiny"})
    assert posted.status == 403 and "needs an API key with scope" in posted.text()
    page.goto(daemon.url + "/ui/playground")
    models_listed(page)
    watch.assert_local(daemon)
    context.close()


def test_a_daemon_without_keys_explains_and_lets_in(tiny_daemon: Daemon, browser: Any) -> None:
    daemon = tiny_daemon
    context = browser.new_context()
    page = context.new_page()
    watch = Watch(page)
    page.goto(daemon.url + "/ui/workloads")
    assert page.url.endswith("/ui/login")
    assert "no API keys" in page.text_content("#no-keys")
    page.click("button[type=submit]")
    page.wait_for_url("**/ui/devices")
    assert page.locator("tr[data-device='cpu:0'] .status").text_content().split()[0] == "Ready"
    page.goto(daemon.url + "/ui/workloads")
    assert page.locator("#submit").count() == 1  # no keys: the admin API is open, so is the page
    watch.assert_local(daemon)
    context.close()


def test_metrics_charts_have_data_after_requests(keyed: Any, browser: Any) -> None:
    daemon, admin, _ = keyed
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key=admin, max_retries=0)
    context, page, watch = login(browser, daemon, admin)
    page.goto(daemon.url + "/ui/metrics")
    stop = threading.Event()

    def load() -> None:  # quantiles are per poll window: requests must end between polls
        while not stop.is_set():
            client.chat.completions.create(model="tiny", max_tokens=8,
                                           messages=[{"role": "user", "content": "Hi"}])  # fmt: skip

    sender = threading.Thread(target=load, daemon=True)
    sender.start()
    try:
        for chart in ("ttft", "tpot", "tokens", "queue"):  # tokens/s needs two polls
            page.wait_for_selector(f"#chart-{chart} polyline", state="attached", timeout=60_000)
        deadline = time.monotonic() + 120  # polled from here: the CSP forbids the eval
        while not page.evaluate(  # that wait_for_function runs in the page to poll
            "[...document.querySelectorAll('#chart-ttft polyline')].some(l => +l.dataset.points >= 2)"
        ):
            assert time.monotonic() < deadline, page.content()
            time.sleep(0.5)
    finally:
        stop.set()
        sender.join(60)
    ttft = page.locator("#chart-ttft polyline").first
    assert ttft.get_attribute("data-series").endswith(("p50", "p99"))
    assert "tiny" in page.text_content("#legend")
    shot(page, "metrics")
    watch.assert_local(daemon)
    context.close()
