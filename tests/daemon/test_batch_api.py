"""The OpenAI Batch API on a real daemon, driven by the real ``openai`` SDK.

Upload, list, delete, create, retrieve, list, download output and error files, token usage,
cancel; refusals of bad input files and of deleting a file a running batch reads; and a
daemon (running one job at a time) SIGKILLed in the middle of a job that, started again on
the same ``KUNLUN_HOME``, finishes it with each ``custom_id`` exactly once, then runs the job
that waited for it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from tests import loopback
from tests.daemons import TINY, Daemon, Daemons, Profile, settled_request_log

TERMINAL = ("completed", "failed", "expired", "cancelled")


def client_for(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)


def request_line(custom_id: str, url: str = "/v1/chat/completions", **body: Any) -> str:
    if url == "/v1/chat/completions":
        payload = {
            "model": "tiny",
            "max_tokens": 6,
            "temperature": 0,
            "messages": [{"role": "user", "content": f"Say {custom_id}."}],
        }
    else:
        payload = {
            "model": "tiny",
            "max_tokens": 6,
            "temperature": 0,
            "prompt": f"Item {custom_id}:",
        }
    payload.update(body)
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": payload})


def upload(client: openai.OpenAI, path: Path, lines: list[str]) -> Any:
    path.write_text("\n".join(lines) + "\n")
    with path.open("rb") as handle:
        return client.files.create(file=handle, purpose="batch")


def wait_for(
    client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...] = TERMINAL, timeout: float = 300
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch}"
        time.sleep(0.2)


def jsonl(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def completed(client: openai.OpenAI, batch_id: str) -> int:
    counts = client.batches.retrieve(batch_id).request_counts
    return counts.completed if counts is not None else 0


def total(client: openai.OpenAI, batch_id: str) -> int:
    counts = client.batches.retrieve(batch_id).request_counts
    return counts.total if counts is not None else 0


def request_log(daemon: Daemon) -> list[dict[str, Any]]:
    return settled_request_log(daemon.home)


def test_batch_with_the_openai_sdk(tiny_daemon: Daemon, tmp_path: Path) -> None:
    daemon = tiny_daemon
    client = client_for(daemon)
    ids = [f"req-{n}" for n in range(6)]
    lines = [request_line(i) for i in ids] + [request_line("too-hot", temperature=5)]
    uploaded = upload(client, tmp_path / "requests.jsonl", lines)
    assert uploaded.purpose == "batch" and uploaded.filename == "requests.jsonl"
    assert uploaded.bytes == (tmp_path / "requests.jsonl").stat().st_size
    assert client.files.retrieve(uploaded.id).id == uploaded.id

    created = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "sdk-test"},
    )
    assert created.status in ("validating", "in_progress") and created.metadata == {
        "job": "sdk-test"
    }
    assert created.expires_at == created.created_at + 24 * 3600
    batch = wait_for(client, created.id)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert (
        batch.request_counts.total,
        batch.request_counts.completed,
        batch.request_counts.failed,
    ) == (7, 6, 1)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    assert batch.output_file_id and batch.error_file_id

    output = jsonl(client.files.content(batch.output_file_id).text)
    assert sorted(line["custom_id"] for line in output) == sorted(ids)
    for line in output:
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["response"]["request_id"] == f"{batch.id}:{line['custom_id']}:1"
        assert line["response"]["body"]["choices"][0]["message"]["content"]
        assert line["id"].startswith("batch_req_")
    usages = [line["response"]["body"]["usage"] for line in output]
    assert all(u["completion_tokens"] >= 1 for u in usages)
    assert batch.model == "tiny" and batch.usage is not None
    assert batch.usage.input_tokens == sum(u["prompt_tokens"] for u in usages) > 0
    assert batch.usage.output_tokens == sum(u["completion_tokens"] for u in usages)
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens
    errors = jsonl(client.files.content(batch.error_file_id).text)
    assert [e["custom_id"] for e in errors] == ["too-hot"]
    assert errors[0]["response"]["status_code"] == 400
    assert "temperature" in errors[0]["response"]["body"]["error"]["message"]
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"

    listed = client.batches.list(limit=100)
    assert batch.id in [b.id for b in listed.data]
    sent = [e for e in request_log(daemon) if str(e["request_id"]).startswith(f"{batch.id}:")]
    assert len(sent) == 7 and {e["model"] for e in sent} == {"tiny"}
    assert sorted(e["status"] for e in sent) == [200] * 6 + [400]


def test_cancel_stops_a_running_batch(tiny_daemon: Daemon, tmp_path: Path) -> None:
    client = client_for(tiny_daemon)
    ids = [f"c{n}" for n in range(60)]
    # long answers (ignore_eos), so the job is still running when it is cancelled: the tiny
    # model would answer 60 short requests before the test could cancel them
    lines = [request_line(i, "/v1/completions", max_tokens=200, ignore_eos=True) for i in ids]
    uploaded = upload(client, tmp_path / "many.jsonl", lines)
    created = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
    )
    wait_for(client, created.id, ("in_progress", *TERMINAL))
    with pytest.raises(openai.ConflictError) as in_use:
        client.files.delete(uploaded.id)
    assert in_use.value.code == "file_in_use" and created.id in in_use.value.message
    assert client.files.retrieve(uploaded.id).id == uploaded.id  # still there
    cancelling = client.batches.cancel(created.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    batch = wait_for(client, created.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    assert batch.request_counts is not None and batch.request_counts.completed < 60
    assert batch.output_file_id
    output = jsonl(client.files.content(batch.output_file_id).text)
    done = [line["custom_id"] for line in output]
    assert len(done) == len(set(done)) == batch.request_counts.completed
    with pytest.raises(openai.BadRequestError, match="already cancelled"):
        client.batches.cancel(created.id)
    assert client.files.delete(uploaded.id).deleted  # the batch has ended: the file can go
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_files_list_paginate_filter_and_delete(tiny_daemon: Daemon, tmp_path: Path) -> None:
    daemon = tiny_daemon
    client = client_for(daemon)
    made = [
        upload(client, tmp_path / f"list-{n}.jsonl", [request_line(f"l{n}", "/v1/completions")])
        for n in range(3)
    ]
    ids = [f.id for f in made]
    newest_first = [f.id for f in client.files.list() if f.id in ids]
    assert newest_first == ids[::-1]
    oldest_first = [f.id for f in client.files.list(order="asc", limit=2) if f.id in ids]
    assert oldest_first == ids  # the SDK follows `after` over pages of 2
    page = client.files.list(purpose="batch", order="asc", after=ids[0], limit=1)
    assert [f.id for f in page.data] == [ids[1]] and page.has_more
    assert all(f.purpose == "batch_output" for f in client.files.list(purpose="batch_output"))

    deleted = client.files.delete(ids[1])
    assert (deleted.id, deleted.deleted, deleted.object) == (ids[1], True, "file")
    assert [f.id for f in client.files.list(order="asc") if f.id in ids] == [ids[0], ids[2]]
    assert not (daemon.home / "files" / ids[1]).exists()
    with pytest.raises(openai.NotFoundError, match=f"no file with id '{ids[1]}'"):
        client.files.delete(ids[1])
    with pytest.raises(openai.NotFoundError):
        client.files.content(ids[1])
    with pytest.raises(openai.BadRequestError, match="'limit' must be an integer from 1 to"):
        client.files.list(limit=0)
    with pytest.raises(openai.BadRequestError, match="'order' must be 'asc' or 'desc'"):
        client.files.list(order="sideways")  # type: ignore[arg-type]


def test_bad_files_and_requests_are_refused_with_the_place(
    tiny_daemon: Daemon, tmp_path: Path
) -> None:
    daemon = tiny_daemon
    client = client_for(daemon)
    lines = [
        request_line("ok"),
        json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}),
        request_line("ok"),
        json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {}}),
        "not json",
    ]
    with pytest.raises(openai.BadRequestError) as caught:
        upload(client, tmp_path / "bad.jsonl", lines)
    message = str(caught.value)
    assert "4 problem(s)" in message
    assert "bad.jsonl:2 (custom_id)" in message
    assert "bad.jsonl:3 (custom_id): custom_id 'ok' repeats line 1" in message
    assert "bad.jsonl:4 (url)" in message and "bad.jsonl:5: not valid JSON" in message

    with pytest.raises(openai.NotFoundError, match="no file with id 'file-nope'"):
        client.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )
    good = upload(client, tmp_path / "good.jsonl", [request_line("a", "/v1/completions")])
    with pytest.raises(openai.BadRequestError, match="completion_window '1h'"):
        client.batches.create(
            input_file_id=good.id, endpoint="/v1/completions", completion_window="1h"
        )  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    # a file whose lines are for another endpoint: the batch fails validation, naming the line
    mismatch = client.batches.create(
        input_file_id=good.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    failed = wait_for(client, mismatch.id)
    assert failed.status == "failed" and failed.errors and failed.errors.data
    assert failed.errors.data[0].line == 1 and failed.errors.data[0].param == "url"
    bare = loopback.post(daemon.url + "/v1/files", data={"purpose": "batch"}, timeout=30)
    assert bare.status_code == 400 and bare.json()["error"]["param"] == "file"


def test_expiry_policies_with_the_openai_sdk(tiny_daemon: Daemon, tmp_path: Path) -> None:
    client = client_for(tiny_daemon)
    path = tmp_path / "expiring.jsonl"
    path.write_text(request_line("e1", "/v1/completions") + "\n")
    with path.open("rb") as handle:
        uploaded = client.files.create(
            file=handle, purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600}
        )
    assert uploaded.expires_at == uploaded.created_at + 3600
    assert client.files.retrieve(uploaded.id).expires_at == uploaded.expires_at
    for bad, field in (({"anchor": "created_at", "seconds": 60}, "expires_after.seconds"),
                       ({"anchor": "last_active_at", "seconds": 3600}, "expires_after.anchor")):  # fmt: skip
        with path.open("rb") as handle, pytest.raises(openai.BadRequestError) as caught:
            client.files.create(file=handle, purpose="batch", expires_after=bad)  # type: ignore[arg-type]
        assert caught.value.param == field, caught.value.body

    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/completions",
            completion_window="24h",
            output_expires_after={"anchor": "created_at", "seconds": 10**9},
        )
    assert refused.value.param == "output_expires_after.seconds"
    assert "from 3600 to 2592000, got 1000000000" in refused.value.message
    created = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )
    batch = wait_for(client, created.id)
    assert batch.status == "completed" and batch.output_file_id
    output = client.files.retrieve(batch.output_file_id)
    assert output.expires_at == output.created_at + 7200
    plain = upload(client, tmp_path / "plain.jsonl", [request_line("p", "/v1/completions")])
    assert plain.expires_at is None


def test_request_ids_pass_through_and_are_logged(tiny_daemon: Daemon) -> None:
    daemon = tiny_daemon
    resp = loopback.post(
        daemon.url + "/v1/completions",
        headers={"X-Request-Id": "probe:1:1"},
        json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
        timeout=120,
    )
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "probe:1:1"
    entry = next(e for e in reversed(request_log(daemon)) if e["request_id"] == "probe:1:1")
    assert entry["model"] == "tiny" and entry["status"] == 200
    assert entry["path"] == "/v1/completions" and entry["latency_ms"] > 0


def test_daemon_sigkill_mid_batch_resumes_each_custom_id_once(daemons: Daemons) -> None:
    crash = Profile("batch-crash-home", (TINY,), args=("--batch-max-jobs", "1"))
    with daemons.serve(crash) as daemon:
        sigkill_mid_batch_and_resume(daemon)


def sigkill_mid_batch_and_resume(daemon: Daemon) -> None:
    client = client_for(daemon)
    ids = [f"k{n}" for n in range(30)]
    # long answers (ignore_eos): 30 requests 8 at a time take several rounds, so the job is
    # in the middle (asserted below) when the daemon is killed
    uploaded = upload(
        client,
        daemon.home / "kill.jsonl",
        [request_line(i, "/v1/completions", max_tokens=200, ignore_eos=True) for i in ids],
    )
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 300
    while completed(client, batch.id) < 5:
        assert time.monotonic() < deadline, "no 5 requests done within 300 s"
        time.sleep(0.05)
    small = upload(client, daemon.home / "after.jsonl", [request_line("w1", "/v1/completions")])
    waiting = client.batches.create(
        input_file_id=small.id, endpoint="/v1/completions", completion_window="24h"
    )
    while total(client, waiting.id) != 1:  # validated, then it waits for the running job
        assert time.monotonic() < deadline, "the second batch was not validated"
        time.sleep(0.02)
    queued = client.batches.retrieve(waiting.id)  # one job at a time: it waits its turn
    assert queued.status == "validating" and queued.in_progress_at is None, queued
    assert daemon.proc is not None
    daemon.proc.kill()
    daemon.proc.wait()
    files_at_kill = {p.name: p.read_bytes() for p in (daemon.home / "files").iterdir()}
    log_mark = len(request_log(daemon))

    daemon.start("--batch-max-jobs", "1")  # same KUNLUN_HOME: workload and batches come back
    client = client_for(daemon)
    third = client.batches.create(  # behind the resumed job and the waiting one
        input_file_id=small.id, endpoint="/v1/completions", completion_window="24h"
    )
    client.batches.cancel(third.id)
    dropped = wait_for(client, third.id)
    assert dropped.status == "cancelled" and dropped.in_progress_at is None, dropped
    assert dropped.output_file_id is None and dropped.usage is None
    done = wait_for(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None and done.request_counts.completed == 30
    output = jsonl(client.files.content(done.output_file_id or "").text)
    assert sorted(line["custom_id"] for line in output) == sorted(ids)  # each exactly once
    assert all(line["response"]["status_code"] == 200 for line in output)

    at_kill = files_at_kill[done.output_file_id or ""]  # complete lines only (not a torn one)
    before = {
        json.loads(line)["custom_id"]
        for line in at_kill.splitlines(keepends=True)
        if line.endswith(b"\n")
    }
    assert 5 <= len(before) < 30, "the job was not in the middle when the daemon was killed"
    assert f"resumed with {len(before)} of 30 requests done" in daemon.log()
    sent_after = {
        str(e["request_id"]).split(":")[1]
        for e in request_log(daemon)[log_mark:]
        if str(e["request_id"]).startswith(f"{batch.id}:")
    }
    assert sent_after and not sent_after & before  # nothing finished was sent again
    second = wait_for(client, waiting.id)  # resumed after the first, oldest first
    assert second.status == "completed" and second.in_progress_at and done.completed_at
    assert second.in_progress_at >= done.completed_at
    assert daemon.stop() == 0


def test_an_unknown_batch_field_is_refused_naming_it(tiny_daemon: Daemon) -> None:
    resp = loopback.post(
        f"{tiny_daemon.url}/v1/batches",
        json={"input_file_id": "file-x", "endpoint": "/v1/completions",
              "completion_window": "24h", "priority_boost": 1},
    )  # fmt: skip
    assert resp.status_code == 400, resp.text
    assert "priority_boost" in resp.json()["error"]["param"]
