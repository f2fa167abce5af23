"""The ``/ui`` dashboard in a real browser (Debian's chromium through Playwright) against a
real daemon with API keys serving the tiny model: login and sessions, Devices, Workloads
(submit from the pickers, the workload's page, stop), the Models catalog and plans per pool,
key management, the Playground (system prompt, conversation, Markdown drawn as text nodes),
the Metrics page's history, scopes, escaping, no console error on any page and no request
leaving the daemon. Screenshots of every page are taken (``SHOTS``)."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from tests.daemons import TINY, Daemon, Profile, daemon_fixture

TEMPLATES = Path(str(importlib.util.find_spec("kunlun.ui").origin)).with_name("templates")  # type: ignore[union-attr]
"""The dashboard's page templates (found without importing the dashboard at collection)."""

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = Path("/usr/bin/chromium")
SHOTS = os.environ.get("KUNLUN_DASHBOARD_SHOTS")
"""Where the pages' screenshots are kept: ``KUNLUN_DASHBOARD_SHOTS`` (the pictures in
``docs/dashboard/`` were taken so); unset, they are taken, checked and dropped (a folder made
at import was left behind by every test process: 1.3 MB each)."""
HOSTILE = "<img src=x onerror=alert(1)>"
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium")


ui_daemon = daemon_fixture(
    Profile(
        "ui-home",
        # A slow device (20 ms a step): the tiny model's answer is spread over a second or
        # more, so the playground's stream reaches the page in more than one read however
        # late the worker or the browser is to read it (test_playground_streams...).
        (TINY + "faults:\n  step_delay_ms: 20\n",),
        keys=(("ops", "admin"), ("reader", "inference")),
        env=(("KUNLUN_UI_SAMPLE_S", "1"),),
        demo=True,
    )
)
"""A daemon with an admin and an inference key, serving the tiny model as ``tiny``; its
catalog holds the demo model as ``smollm2`` (not served: the Models page's subject)."""


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
    """Every URL a page requests, every dialog it opens and every error its console shows
    (a failed load, a refused script, an exception)."""

    def __init__(self, page: Any) -> None:
        self.urls: list[str] = []
        self.dialogs: list[str] = []
        self.errors: list[str] = []
        page.on("request", lambda r: self.urls.append(r.url))
        page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        page.on("console", lambda m: m.type == "error" and self.errors.append(
            f"{m.text} ({m.location.get('url')})"))  # fmt: skip
        page.on("pageerror", lambda e: self.errors.append(f"exception: {e}"))

    def assert_local(self, daemon: Daemon, refusals: int = 0) -> None:
        """Nothing left the daemon, no dialog opened, and the console showed no error but
        ``refusals``: pages that answered a bad form the test sent on purpose with a 4xx
        (a refused login, a field named as wrong), which the browser logs as a failed load."""
        outside = [u for u in self.urls if not u.startswith(daemon.url + "/")]
        assert self.urls and not outside, outside
        assert not self.dialogs
        assert len(self.errors) == refusals, self.errors
        assert all("responded with a status of 4" in e for e in self.errors), self.errors


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
    path = None
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        path = str(Path(SHOTS) / f"{name}.png")
    image = page.screenshot(path=path, full_page=True)
    assert image.startswith(b"\x89PNG"), f"the {name} page's screenshot is no PNG"


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
    # the refused logins' pages (a wrong key: 401, no key: 400), and nothing else
    assert sorted(e.split("status of ")[1][:3] for e in watch.errors) == ["400", "401"], (
        watch.errors
    )
    watch.assert_local(daemon, refusals=2)
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
    # the pickers offer what the daemon has: its devices, its engines, the schemes, the tasks
    assert page.locator("#submit select[name=device] option[value='cpu:0']").count() == 1
    engines = page.locator("#submit select[name=engine] option").all_text_contents()
    assert "kunlun" in engines and "llama.cpp" in engines, engines
    schemes = page.locator("#submit select[name=quantization] option").all_text_contents()
    assert schemes == ["none", "w8a8", "w8a16", "w4a16"], schemes
    assert page.locator("#submit select[name=task] option").all_text_contents() == [
        "generate", "embed"]  # fmt: skip
    catalog = daemon.get("/api/v1/models", headers={"authorization": f"Bearer {admin}"}).json()
    offered = page.locator("#model-choices option").evaluate_all("os => os.map(o => o.value)")
    assert offered == sorted(m["alias"] for m in catalog)  # the catalog's aliases
    page.select_option("#submit select[name=device]", "cpu:0")
    page.select_option("#submit select[name=engine]", "kunlun")
    page.select_option("#submit select[name=quantization]", "w8a16")
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
    plan = dict(zip(page.locator("#plan th").all_text_contents(),
                    page.locator("#plan td").all_text_contents(), strict=True))  # fmt: skip
    assert plan["quantization"] == "w8a16" and plan["engine"] == "kunlun", plan
    assert "engine kunlun" in page.text_content("#plan-line")
    assert "{'" not in page.text_content("main")  # no Python dict printed as it is
    shot(page, "workload")
    page.goto(daemon.url + "/ui/workloads")
    second = page.locator("tr[data-name=second]")
    assert second.locator(".state").text_content() == "RUNNING"
    shot(page, "workloads")
    second.locator("button.stop").click()
    page.wait_for_url("**/ui/workloads")
    assert page.locator("tr[data-name=second] .state").text_content() in ("STOPPING", "STOPPED")
    watch.assert_local(daemon, refusals=3)  # the three bad submissions
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
    # The workload's 20 ms steps spread the 64 tokens over more than a second: drawing chunk
    # by chunk shows as the reply growing more than once. (At the tiny model's own pace the
    # whole answer could reach a late reader in one read, and the page would draw once.)
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
    assert "tiny" in page.text_content("#legend") and "on cpu:0" in page.text_content("#legend")
    page.reload()  # the history is the daemon's: a new page load draws it at once
    page.locator("#chart-ttft polyline").first.wait_for(state="attached", timeout=10_000)
    assert max(int(n) for n in page.locator("#chart-ttft polyline").evaluate_all(
        "lines => lines.map(l => l.dataset.points)")) >= 2  # fmt: skip
    ticks = page.locator("#chart-ttft text.time").all_text_contents()
    assert len(ticks) == 4 and all(len(t) == 8 and t.count(":") == 2 for t in ticks), ticks
    assert page.text_content("#chart-ttft text.unit") == "ms"
    assert page.text_content("#chart-kv text.unit") == "%"
    shot(page, "metrics")
    watch.assert_local(daemon)
    context.close()


PAGES = ("devices", "workloads", "models", "metrics", "playground", "batches", "validation",
         "bench", "adaptation", "nodes", "rollouts", "keys")  # fmt: skip
"""Every page of the navigation bar (an admin's)."""


SCRIPTED = {p for p in PAGES if "<script" in (TEMPLATES / f"{p}.html").read_text()}
"""The pages with a script, which fetches their data after the load (metrics, playground);
the others are rendered whole by the daemon, and waiting for the network to go idle would
cost half a second a page."""


def test_every_page_opens_without_a_console_error(keyed: Any, browser: Any) -> None:
    daemon, admin, reader = keyed
    for key, pages in ((admin, PAGES), (reader, [p for p in PAGES if p != "keys"])):
        context, page, watch = login(browser, daemon, key)
        nav = page.locator("header nav a").all_text_contents()
        assert [n.lower() for n in nav] == list(pages), nav  # Keys only for an admin
        for name in pages:
            page.click(f"header nav a[href='/ui/{name}']")
            page.wait_for_url(f"**/ui/{name}")  # loaded: the server renders the page
            if name in SCRIPTED:  # and its script's first fetches are answered
                page.wait_for_load_state("networkidle")
            assert "{'" not in page.text_content("main"), name
        page.goto(daemon.url + "/ui/metrics")
        page.locator("#chart-ttft text.time").first.wait_for(state="attached", timeout=30_000)
        watch.assert_local(daemon)
        context.close()


def test_the_workload_page_leaves_out_health_probe_lines(keyed: Any, browser: Any) -> None:
    daemon, admin, _ = keyed
    context, page, watch = login(browser, daemon, admin)
    page.goto(daemon.url + "/ui/workloads")
    page.click("tr[data-name=tiny] a")
    page.wait_for_url("**/ui/workloads/*")
    deadline = time.monotonic() + 60  # the daemon probes each replica every 5 s
    while "left out" not in page.text_content("#probes"):
        assert time.monotonic() < deadline, page.text_content("#probes")
        time.sleep(1)
        page.reload()
    assert "health_probe" not in page.text_content("#log")
    page.click("#probes a")
    assert "health_probe" in page.text_content("#log")
    assert "shown" in page.text_content("#probes")
    watch.assert_local(daemon)
    context.close()


def test_models_page_lists_forms_sizes_and_plans_per_pool(keyed: Any, browser: Any) -> None:
    daemon, admin, _ = keyed
    made = daemon.cli("model", "quantize", "--model", "smollm2", "--quantization", "w8a16",
                      key=admin)  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    workloads = len(
        daemon.get("/api/v1/workloads", headers={"authorization": f"Bearer {admin}"}).json()
    )
    context, page, watch = login(browser, daemon, admin)
    page.goto(daemon.url + "/ui/models")
    row = page.locator("tr[data-alias='smollm2']")
    assert row.locator(".forms").text_content() == "smollm2-w8a16"  # quantized from it
    assert row.locator(".form").text_content() in ("float32", "bfloat16")  # its checkpoint's
    quantized = page.locator("tr[data-alias='smollm2-w8a16']")
    assert quantized.locator(".form").text_content().startswith("w8a16")
    assert quantized.locator(".forms").text_content() == "smollm2"
    sizes = [
        float(r.locator(".size").text_content().removesuffix(" MiB")) for r in (row, quantized)
    ]
    assert sizes[1] < sizes[0], sizes  # int8 weights take less room
    shot(page, "models")
    quantized.locator("a").click()
    page.wait_for_url("**/ui/models/smollm2-w8a16")
    pool = page.locator("section.pool[data-pool=cpu]")
    line = pool.locator(".plan-line").text_content()
    assert "smollm2-w8a16 on cpu:0: engine" in line and "quantization w8a16" in line, line
    assert "KV" in line
    assert "planned on cpu:0" in pool.text_content()
    after = daemon.get("/api/v1/workloads", headers={"authorization": f"Bearer {admin}"}).json()
    assert len(after) == workloads  # dry runs: nothing was submitted
    shot(page, "model")
    missing = page.request.get(daemon.url + "/ui/models/no-such-model")
    assert missing.status == 404 and "no model &#39;no-such-model&#39;" in missing.text()
    watch.assert_local(daemon)
    context.close()


def test_keys_page_creates_a_key_that_works_and_revokes_it(keyed: Any, browser: Any) -> None:
    daemon, admin, reader = keyed
    context, page, watch = login(browser, daemon, admin)
    page.goto(daemon.url + "/ui/keys")
    assert page.locator("tr[data-name=reader] td").nth(2).text_content() == "inference"
    assert reader not in page.content()  # secrets are never listed
    page.fill("#create-key input[name=name]", "from-the-page")
    page.fill("#create-key input[name=rpm]", "lots")
    page.click("#create-key button[type=submit]")
    assert "rpm" in page.text_content("#form-error") and "lots" in page.text_content("#form-error")
    page.fill("#create-key input[name=rpm]", "600")
    page.select_option("#create-key select[name=scope]", "inference")
    page.select_option("#create-key select[name=priority]", "low")
    page.click("#create-key button[type=submit]")
    secret = page.text_content("#secret").strip()
    row = page.locator("tr[data-name=from-the-page]")
    assert "600 req/min" in row.text_content() and "low" in row.text_content()
    shot(page, "keys")
    sdk = openai.OpenAI(base_url=daemon.url + "/v1", api_key=secret, max_retries=0)
    assert [m.id for m in sdk.models.list()] == ["tiny"]
    page.goto(daemon.url + "/ui/keys")  # the secret is not shown again
    assert secret not in page.content()
    with page.expect_navigation():
        page.locator("tr[data-name=from-the-page] button.revoke").click()
    assert page.locator("tr[data-name=from-the-page] .state").text_content().startswith("revoked")
    with pytest.raises(openai.AuthenticationError):
        sdk.models.list()
    watch.assert_local(daemon, refusals=1)  # rpm "lots"
    context.close()
    context, page, watch = login(browser, daemon, reader)
    page.goto(daemon.url + "/ui/keys")
    assert "scope 'admin'" in page.text_content("main")  # the admin API's own refusal
    assert page.locator("#create-key").count() == 0
    watch.assert_local(daemon)
    context.close()


MARKDOWN = (
    "# Title\nSome **bold** and *slanted* text with `code` and [a link](https://example.org) "
    "and [no link](javascript:alert(1)).\n\n- one\n- two <b>x</b>\n\n1. first\n\n"
    f"```python\nprint('{HOSTILE}')\n```\nend {HOSTILE}"
)


def test_playground_keeps_a_conversation_with_a_system_prompt(keyed: Any, browser: Any) -> None:
    daemon, admin, _ = keyed
    context, page, watch = login(browser, daemon, admin)
    page.goto(daemon.url + "/ui/playground")
    models_listed(page)
    drawn = page.evaluate(
        "t => { const d = document.createElement('div'); d.appendChild(renderMarkdown(t));"
        " return d.innerHTML; }", MARKDOWN)  # fmt: skip
    assert drawn.startswith("<h3>Title</h3><p>Some <strong>bold</strong> and <em>slanted</em>")
    assert '<code>code</code> and <a href="https://example.org" rel="noopener noreferrer"' in drawn
    assert "[no link](javascript:alert(1))" in drawn and 'href="javascript' not in drawn
    assert "<ul><li>one</li><li>two &lt;b&gt;x&lt;/b&gt;</li></ul><ol><li>first</li></ol>" in drawn
    assert (
        "<pre><code data-lang=\"python\">print('&lt;img src=x onerror=alert(1)&gt;')</code></pre>"
        in drawn
    )
    assert "<img" not in drawn and "<b>" not in drawn  # text, never markup
    page.fill("#system", "You answer in one short sentence.")
    page.fill("#max_tokens", "8")
    page.fill("#temperature", "0")
    sent, streamed = [], []
    for prompt in ("Hello there.", "And again?"):
        page.fill("#prompt", prompt)
        with page.expect_response("**/ui/call/v1/chat/completions") as response:
            page.click("#send")
        sent.append(response.value.request.post_data_json["messages"])
        page.locator(".msg.assistant[data-done='1']").nth(len(sent) - 1).wait_for(timeout=120_000)
        streamed.append("".join(
            (json.loads(line[5:])["choices"] or [{}])[0].get("delta", {}).get("content") or ""
            for line in response.value.text().splitlines()
            if line.startswith("data:") and line[5:].strip() != "[DONE]"))  # fmt: skip
    assert sent[0] == [{"role": "system", "content": "You answer in one short sentence."},
                       {"role": "user", "content": "Hello there."}]  # fmt: skip
    assert sent[1][:2] == sent[0]
    assert sent[1][2] == {"role": "assistant", "content": streamed[0]}  # the reply as streamed
    assert sent[1][3] == {"role": "user", "content": "And again?"}
    assert page.text_content("#turns") == "2"
    assert "And again?" in page.text_content("#curl")  # the next request carries the history
    assert "You answer in one short sentence." in page.text_content("#python")
    shot(page, "playground-conversation")
    page.click("#new-chat")
    assert page.locator(".msg").count() == 0 and page.text_content("#turns") == "0"
    watch.assert_local(daemon)
    context.close()
