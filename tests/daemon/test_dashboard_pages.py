"""The dashboard's second set of pages in a real browser (Debian's chromium through Playwright)
against one real daemon: a replayed 24-GPU node (:mod:`tests.daemon.big_node`) plus ``cpu:0``
serving the tiny model, with an admin and an inference key.

The Devices heat map, the Metrics page's per-device and per-priority-class series (after
requests with ``X-Kunlun-Priority``) and windowed quantiles, scaling a workload from the
page until the new replica count is ready, a batch job submitted with the openai SDK and its
progress, the Nodes and Rollouts pages, the Validation and Bench pages drawn from a real
``kunlun-cli validate`` run (of the demo model on the shared daemon: it passes only on answers
that read as language) and ``kunlun-cli bench`` run written under ``KUNLUN_HOME/reports``, and
the Adaptation page drawn from real ``kunlun-cli adapt`` and ``kunlun-cli acceptance`` runs
(and the report files it serves, from there only). Screenshots are taken as in
``test_dashboard_ui.py`` (``SHOTS``)."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from tests import loopback
from tests.daemon.big_node import write_node
from tests.daemon.test_dashboard_ui import CHROMIUM, HOSTILE, login, shot
from tests.daemons import TINY, Daemon, Daemons, Profile

sync_api = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium")
GPUS = 24


REPLAYED = Profile(
    "ui-pages-home", (TINY + "device: cpu:0\n",), keys=(("ops", "admin"), ("reader", "inference")),
    env=(("KUNLUN_REPLAY_DIR", "{home}/node"), ("KUNLUN_UI_SAMPLE_S", "1")),
)  # fmt: skip


@pytest.fixture(scope="module")
def node(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The daemon on the replayed node (:func:`write_node`), the tiny model serving on cpu:0
    as ``tiny``; (daemon, admin, reader)."""
    daemons = Daemons(request)
    home = daemons.home(REPLAYED)
    write_node(home / "node", GPUS)
    with daemons.serve(REPLAYED, home) as d:
        yield d, d.keys["ops"], d.keys["reader"]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as play:
        chromium = play.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        yield chromium
        chromium.close()


def client(daemon: Daemon, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key=key, max_retries=0)


def wait_until(page: Any, check: Any, timeout_s: float = 120, reload: bool = True) -> None:
    """Poll ``check()`` (reloading the page between tries) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, page.content()[:4000]
        time.sleep(0.5)
        if reload:
            page.reload()


def test_devices_page_draws_the_topology_heat_map(node: Any, browser: Any) -> None:
    daemon, admin, _ = node
    context, page, watch = login(browser, daemon, admin)
    assert page.locator("#devices tr[data-device]").count() == GPUS + 1
    heat = page.locator(".heatmap[data-type=nvidia]")
    cells = heat.locator("td[data-d]")
    assert cells.count() == GPUS * GPUS
    first = heat.locator("tr").nth(1).locator("td")  # nvidia:0's row
    assert first.nth(0).get_attribute("class") == "link-self"
    assert (first.nth(1).get_attribute("class"), first.nth(1).get_attribute("data-d")) == (
        "link-fast", "5")  # fmt: skip  # NVLink inside a board of 8
    assert first.nth(8).get_attribute("class") == "link-sys"  # the other socket's board
    assert first.nth(16).get_attribute("class") == "link-node"  # a board on the same socket
    colours = {
        first.nth(i).evaluate("e => getComputedStyle(e).backgroundColor") for i in (0, 1, 8, 16)
    }
    assert len(colours) == 4  # the stylesheet colours each class
    assert "NVLink" in page.text_content(".heat-legend")
    shot(page, "devices-topology")
    watch.assert_local(daemon)
    context.close()


def test_metrics_per_device_and_priority_class_windowed(node: Any, browser: Any) -> None:
    daemon, admin, _ = node
    context, page, watch = login(browser, daemon, admin)
    bad = page.request.get(daemon.url + "/ui/metrics.json?after=1&window=9")
    assert bad.status == 400 and bad.json()["error"]["param"] == "window"
    for after in ("soon", "nan", "inf"):
        refused = page.request.get(daemon.url + f"/ui/metrics.json?after={after}")
        assert refused.status == 400 and refused.json()["error"]["param"] == "after"
    page.goto(daemon.url + "/ui/metrics")
    page.wait_for_selector("#chart-prio-queued polyline", state="attached", timeout=30_000)
    queued = {page.locator("#chart-prio-queued polyline").nth(i).get_attribute("data-series")
              for i in range(page.locator("#chart-prio-queued polyline").count())}  # fmt: skip
    assert queued == {"high", "normal", "low"}  # every class of the served model, from poll 1
    chat = client(daemon, admin)
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            for priority in ("high", "low"):
                chat.chat.completions.create(
                    model="tiny", max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                    extra_headers={"X-Kunlun-Priority": priority})  # fmt: skip

    sender = threading.Thread(target=load, daemon=True)
    sender.start()
    try:

        def drawn() -> bool:
            series = page.evaluate("""() => [...document.querySelectorAll(
                '#chart-prio-wait polyline, #chart-dev-ttft polyline, #chart-ttft polyline')]
                .map(l => l.closest('svg').id + '|' + l.dataset.series + '|' + l.dataset.points)""")
            names = {s.rsplit("|", 1)[0] for s in series if int(s.rsplit("|", 1)[1]) >= 2}
            return {"chart-prio-wait|high p99", "chart-prio-wait|low p99",
                    "chart-dev-ttft|cpu:0 p99"} <= names  # fmt: skip

        wait_until(page, drawn, 180, reload=False)
    finally:
        stop.set()
        sender.join(60)
    stopped = time.time()
    assert "last window" in page.text_content("#window")
    history = page.request.get(daemon.url + "/ui/metrics.json").json()
    assert history["interval_s"] == 1 and history["keep_s"] == 900
    times = [p["ts"] for p in history["points"]]
    assert times == sorted(times) and times[-1] - times[0] > 5  # kept by the daemon
    assert all(0 < p["window_s"] < 30 for p in history["points"][1:])  # between two samples
    deadline = time.monotonic() + 60
    while len(later := page.request.get(
            daemon.url + f"/ui/metrics.json?after={stopped + 0.5}").json()["points"]) < 2:  # fmt: skip
        assert time.monotonic() < deadline, later
        time.sleep(0.5)
    assert later[-1]["priorities"]["high"]["wait_p99_s"] is None  # no request ended in between
    assert later[-1]["priorities"]["high"]["requests_per_s"] == 0
    assert all(p["ts"] > stopped + 0.5 for p in later)  # only the points after the one asked
    shot(page, "metrics-windows")
    watch.assert_local(daemon)
    context.close()


def test_scale_from_the_workloads_page(node: Any, browser: Any) -> None:
    daemon, admin, _ = node
    context, page, watch = login(browser, daemon, admin)
    page.goto(daemon.url + "/ui/workloads")
    row = "tr[data-name=tiny]"
    for value, words in (("many", "whole number"), ("17", "replicas")):
        page.fill(f"{row} .scale input[name=replicas]", value)
        page.click(f"{row} .scale button")
        message = page.text_content("#form-error")
        assert "replicas" in message and words in message, message
    page.fill(f"{row} .scale input[name=replicas]", "2")
    page.click(f"{row} .scale button")
    page.wait_for_url("**/ui/workloads")
    wait_until(page, lambda: page.locator(row).locator("td").nth(4).text_content() == "2/2", 300)
    shot(page, "workloads-scaled")
    described = daemon.describe("tiny", key=admin)
    assert sum(1 for r in described["replicas"] if r["ready"]) == 2
    assert any(e["kind"] == "scaled" for e in described["events"])
    page.fill(f"{row} .scale input[name=replicas]", "1")
    page.click(f"{row} .scale button")
    page.wait_for_url("**/ui/workloads")
    wait_until(page, lambda: page.locator(row).locator("td").nth(4).text_content() == "1/1", 120)
    proc = daemon.cli("workload", "scale", "tiny", "0", key=admin)
    assert proc.returncode != 0 and "replicas" in proc.stderr + proc.stdout
    auth = {"authorization": f"Bearer {admin}"}
    for body, param in (({"replicas": 2, "count": 2}, "count"), ({"replicas": "x"}, "replicas")):
        refused = loopback.post(daemon.url + "/api/v1/workloads/tiny/scale", json=body,
                             headers=auth, timeout=30)  # fmt: skip
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    watch.assert_local(daemon, refusals=2)  # "many" and "17"
    context.close()


def test_batches_page_shows_a_batch_and_its_progress(node: Any, browser: Any) -> None:
    daemon, admin, _ = node
    sdk = client(daemon, admin)
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "tiny", "max_tokens": 2,
                                  "messages": [{"role": "user", "content": f"Hi {i}"}]}})
             for i in range(3)]  # fmt: skip
    upload = sdk.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())),
                              purpose="batch")  # fmt: skip
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                               completion_window="24h", metadata={"name": HOSTILE})  # fmt: skip
    context, page, watch = login(browser, daemon, admin)
    page.goto(daemon.url + "/ui/batches")
    row = page.locator(f"tr[data-batch='{batch.id}']")
    assert HOSTILE in row.text_content() and page.locator("img").count() == 0
    wait_until(page, lambda: row.locator(".state").text_content() == "completed", 300)
    progress = row.locator("progress")
    assert progress.get_attribute("value") == progress.get_attribute("max") == "3"
    assert "3 done, 0 failed of 3" in row.text_content()
    shot(page, "batches")
    watch.assert_local(daemon)
    assert not watch.dialogs
    context.close()


def test_nodes_and_rollouts_pages(node: Any, browser: Any) -> None:
    daemon, admin, _ = node
    context, page, watch = login(browser, daemon, admin)
    page.goto(daemon.url + "/ui/nodes")
    assert "single node" in page.text_content("#single-node")
    (row,) = page.locator("#nodes tr[data-node]").all()
    assert f"{GPUS + 1} · {GPUS + 1} Ready" in row.text_content()
    shot(page, "nodes")
    page.goto(daemon.url + "/ui/rollouts")
    assert page.locator("#no-rollouts").count() == 1  # the daemon has none
    shot(page, "rollouts")
    watch.assert_local(daemon)
    context.close()


def test_validation_and_bench_pages_read_the_reports(
    node: Any, browser: Any, daemon: Daemon
) -> None:
    """The reports the pages read: a ``validate`` run of the demo model (the shared ``daemon``:
    the run passes only when its garbage detector finds every answer to be language, which
    the tiny random model's are not) and a ``bench`` run of the node's tiny model, both
    written under the node's ``KUNLUN_HOME/reports``."""
    demo = daemon
    daemon, admin, reader = node
    context, page, watch = login(browser, daemon, admin)
    page.goto(daemon.url + "/ui/validation")
    assert page.locator("#no-validation").count() == 1
    reports = daemon.home / "reports"
    runs = (["validate", "--endpoint", demo.url, "--model", "smollm2", "--only", "api.sse",
             "--out", str(reports / "validation-1")],
            ["bench", "--endpoint", daemon.url, "--model", "tiny", "--concurrency", "1,2",
             "--num-prompts", "2", "--input-len", "16", "--output-len", "16",
             "--out", str(reports / "bench-1")])  # fmt: skip
    for argv in runs:
        done = daemon.cli(*argv, key=admin, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
    page.goto(daemon.url + "/ui/validation")
    assert page.text_content("#validation-file") == "reports/validation-1/validation.json"
    cell = page.locator("#validation tr[data-row='api.sse'] td").nth(1)
    assert cell.locator(".pass").text_content() == "PASS"
    shot(page, "validation")
    page.goto(daemon.url + "/ui/bench")
    lines = page.locator("#bench polyline")
    assert lines.count() == 5  # tokens/s, TTFT p50/p99, TPOT p50/p99
    # one point per concurrency level where the report has the figure (a level whose every
    # token arrived in one network read has no TPOT: bench.json says None, the page skips it)
    runs = json.loads((reports / "bench-1" / "bench.json").read_text())["runs"]
    figures = [[r["output_tokens_per_s"] for r in runs],
               *([(r[f"{what}_ms"] or {}).get(q) for r in runs]
                 for what in ("ttft", "tpot") for q in ("p50", "p99"))]  # fmt: skip
    assert len(figures[0]) == 2 and None not in figures[0] + figures[1]
    for i, values in enumerate(figures):
        points = lines.nth(i).get_attribute("points").split()
        assert len(points) == sum(v is not None for v in values), (i, values, points)
    assert page.locator("#bench-runs tr").count() == 3
    shot(page, "bench")
    watch.assert_local(daemon)
    context.close()
    context, page, watch = login(browser, daemon, reader)
    for path in ("/ui/validation", "/ui/bench"):
        page.goto(daemon.url + path)
        assert "admin key" in page.text_content(".error")
    page.goto(daemon.url + "/ui/workloads")
    assert page.locator(".scale").count() == 0
    posted = page.request.post(daemon.url + "/ui/workloads/tiny/scale", form={"replicas": "2"})
    assert posted.status == 403
    context.close()


def test_adaptation_page_shows_verdicts_snapshots_and_acceptance_reports(
    node: Any, browser: Any, tiny_model: Path, tmp_path: Path
) -> None:
    """A real ``kunlun-cli adapt`` of the tiny model on the node's cpu pool and a signed
    ``kunlun-cli acceptance --layer 1`` of the replayed node, both written under the node's
    ``KUNLUN_HOME/reports``; the page shows what their files say, and ``/ui/reports/...``
    serves report files from there and nowhere else."""
    daemon, admin, reader = node
    home, reports = daemon.home, daemon.home / "reports"
    context, page, watch = login(browser, daemon, admin)
    page.goto(daemon.url + "/ui/adaptation")
    for empty in ("#no-adaptation", "#no-snapshots", "#no-acceptance"):
        assert page.locator(empty).count() == 1, empty
    runs = {}
    # api.sse: the garbage detector judges the tiny model's answers (noise) and fails the
    # battery gate, exit 1, nothing saved; api.models: nothing to judge, every gate that runs
    # passes, exit 0, and the run's snapshot is saved as known-good
    for out, row, code in (("adapt-1", "api.sse", 1), ("adapt-2", "api.models", 0)):
        done = daemon.cli("adapt", "--model", str(tiny_model), "--pools", "cpu", "--only", row,
                          "--concurrency", "1", "--requests", "2", "--output-len", "8",
                          "--snapshots", str(home / "snapshots"), "--out", str(reports / out),
                          key=admin, timeout=600)  # fmt: skip
        runs[out] = json.loads((reports / out / "adapt.json").read_text())
        (column,) = runs[out]["columns"]
        failed = any(v["status"] == "FAIL" for v in column["verdicts"].values())
        assert done.returncode == (1 if failed else 0) == code, done.stdout + done.stderr
        assert column["column"] == "cpu/kunlun" and len(runs[out]["snapshots"]) == 1 - code
        time.sleep(0.05)  # the second's file is the newer one
    assert runs["adapt-1"]["columns"][0]["verdicts"]["battery"]["status"] == "FAIL"
    doc = runs["adapt-2"]
    (column,) = doc["columns"]
    keys = tmp_path / "keys"
    assert daemon.cli("keys", "generate", "--out", str(keys), remote=False).returncode == 0
    accepted = daemon.cli("acceptance", "--layer", "1", "--out", str(reports / "acceptance-1"),
                          "--sign", str(keys / "kunlun-signing.key"), key=admin, timeout=600)  # fmt: skip
    layer1 = json.loads((reports / "acceptance-1" / "acceptance-layer1.json").read_text())
    # (exit 0 only for PASS: a checkpoint not run on the replayed node leaves it unproven)
    assert accepted.returncode == (0 if layer1["verdict"] == "PASS" else 1), accepted.stdout
    broken = reports / "adapt-broken" / "adapt.json"
    broken.parent.mkdir()
    broken.write_text("{not json")
    (home / "snapshots" / "broken.json").write_text("[]")  # not a snapshot

    page.goto(daemon.url + "/ui/adaptation")
    (section,) = page.locator("#adaptation section.adapt").all()
    assert section.get_attribute("data-model") == str(tiny_model)
    assert section.locator(".adapt-file").text_content() == "reports/adapt-2/adapt.json"
    assert "reports/adapt-1/adapt.json" in section.text_content()  # the older run, listed
    assert "total" in section.locator(".adapt-seconds").text_content()
    row = section.locator("tr[data-column='cpu/kunlun']")
    shown = [row.locator(f"td[data-gate='{g}'] span").text_content() for g in doc["gates"]]
    assert shown == [column["verdicts"][g]["status"] for g in doc["gates"]]
    verdict = section.locator(".pool-verdict[data-pool='cpu']").text_content()
    assert verdict.startswith("adapted") and "pool cpu with kunlun" in verdict, verdict
    assert "reports/adapt-broken/adapt.json" in page.text_content("#report-errors")
    assert "broken.json" in page.text_content("#snapshot-errors")  # said, not skipped
    saved = {Path(p).stem for p in doc["snapshots"]}
    rows = page.locator("#snapshots tr[data-snapshot]")
    assert {rows.nth(i).get_attribute("data-snapshot") for i in range(rows.count())} == saved
    for stem in saved:
        cells = page.locator(f"#snapshots tr[data-snapshot='{stem}'] td").all_text_contents()
        assert cells[1:4] == [str(tiny_model), "cpu", "kunlun"], cells
        assert float(cells[6]) > 0, cells  # output tokens/s of the bench
    report = page.locator(
        "#acceptance tr[data-report='reports/acceptance-1/acceptance-layer1.json']"
    )
    assert report.locator(".verdict").text_content() == layer1["verdict"]
    for name in layer1.get("not_run") or []:
        assert name in report.locator("td").nth(2).text_content()
    assert report.locator(".signed").text_content() == "signed (.sig)"
    shot(page, "adaptation")
    with page.expect_navigation() as opened:
        report.locator(".report-link").click()
    answer = opened.value
    assert answer.status == 200 and "script-src" not in answer.headers["content-security-policy"]
    assert "default-src 'none'" in answer.headers["content-security-policy"]
    assert page.text_content("h1").startswith("Layer 1: device visibility")
    # its screenshot of the Devices page, taken by the acceptance run, shown from beside it
    assert list(layer1["screenshots"]["files"]) == ["/ui/devices"], layer1["screenshots"]
    image = page.locator("img[alt='/ui/devices']")
    assert image.evaluate("i => i.complete && i.naturalWidth") == 1280
    served = daemon.url + "/ui/reports/acceptance-1/acceptance-layer1"
    for suffix in (".md", ".json", ".json.sig"):
        assert page.request.get(served + suffix).status == 200, suffix
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.json").write_text("{}")
    (reports / "acceptance-1" / "leak.json").symlink_to(outside / "secret.json")
    (reports / "out").symlink_to(outside, target_is_directory=True)
    (reports / "acceptance-1" / "notes.txt").write_text("not a report file")
    (home / "outside.json").write_text("{}")
    for refused in ("../state.db", "..%2Fstate.db", "..%2Foutside.json",
                    "acceptance-1/..%2F..%2Foutside.json", "acceptance-1/leak.json",
                    "out/secret.json", "acceptance-1/notes.txt", "acceptance-1/none.html"):  # fmt: skip
        got = page.request.get(daemon.url + "/ui/reports/" + refused)
        assert got.status == 404, (refused, got.status, got.text()[:200])
    watch.assert_local(daemon)
    context.close()
    context, page, watch = login(browser, daemon, reader)
    page.goto(daemon.url + "/ui/adaptation")
    assert "admin key" in page.text_content(".error")
    assert page.locator("#adaptation, #snapshots, #acceptance").count() == 0
    assert page.request.get(served + ".html").status == 403
    watch.assert_local(daemon)
    context.close()
