"""The gateway in front of a real worker, driven by the real ``openai`` SDK."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import httpx
import openai
import pytest
from tests import loopback
from tests.serving.conftest import gateway_over

from kunlun.serving.replica import Replica

if TYPE_CHECKING:
    from .conftest import GatewayServer, WorkerProcess

MODEL = "smollm2"
MAX_MODEL_LEN = 512  # as the worker fixture is started with
PARIS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def client(gateway: GatewayServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="x", max_retries=0, timeout=120)


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def sse_events(response: httpx.Response) -> Iterator[str]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]


def test_chat_answers_paris_through_the_gateway(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=PARIS,
        temperature=0,
        max_tokens=32,
        extra_headers={"X-Request-Id": "req-paris"},
    )
    assert raw.headers["x-kunlun-replica"] == "r1"
    assert raw.headers["x-kunlun-device"] == "cpu:0"
    assert raw.headers["x-kunlun-priority"] == "normal"
    assert raw.headers["x-request-id"] == "req-paris"
    completion = raw.parse()
    assert "Paris" in completion.choices[0].message.content
    assert completion.choices[0].finish_reason == "stop"
    usage = completion.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


@pytest.mark.parametrize("include_usage", [False, True])
def test_streaming_chat(client: openai.OpenAI, include_usage: bool) -> None:
    options = {"include_usage": True} if include_usage else None
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=PARIS, temperature=0, max_tokens=4, stream=True,
        stream_options=options,
    ))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith("The capital")
    assert chunks[0].choices[0].delta.role == "assistant"
    if include_usage:
        assert chunks[-1].choices == []
        assert chunks[-1].usage.completion_tokens == 4
        assert all(c.usage is None for c in chunks[:-1])
        assert chunks[-2].choices[0].finish_reason == "length"
    else:
        assert all(c.usage is None for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_echo_with_logprobs(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    completion = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2
    )
    choice = completion.choices[0]
    assert choice.text.startswith(prompt + " Paris")
    logprobs = choice.logprobs
    num_tokens = completion.usage.prompt_tokens + completion.usage.completion_tokens
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == num_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs[1:])
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


def test_n_and_seed(client: openai.OpenAI) -> None:
    def sample(seed: int) -> list[str]:
        completion = client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1, n=2, seed=seed
        )
        assert sorted(c.index for c in completion.choices) == [0, 1]
        return [c.text for c in sorted(completion.choices, key=lambda c: c.index)]

    first = sample(1234)
    assert sample(1234) == first


def test_stop_string(client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stop=["."]
    )
    assert completion.choices[0].text == " Paris"
    assert completion.choices[0].finish_reason == "stop"


def test_bad_requests_answer_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=PARIS, temperature=-1)
    assert caught.value.body["param"] == "temperature"
    assert "temperature=-1" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="hello " * MAX_MODEL_LEN, max_tokens=4)
    assert caught.value.body["code"] == "context_length_exceeded"
    assert "max_model_len" in caught.value.body["message"]


def test_bad_json_and_missing_model(gateway: GatewayServer) -> None:
    url = f"{gateway.base_url}/v1/chat/completions"
    response = loopback.post(
        url, content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    response = loopback.post(url, json={"messages": PARIS})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "model"


def test_oversized_body_answers_413(gateway: GatewayServer) -> None:
    from kunlun.serving.gateway import MAX_BODY_BYTES

    url = f"{gateway.base_url}/v1/completions"
    body = b'{"model": "smollm2", "prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    response = loopback.post(url, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "serving.body_too_large" and str(MAX_BODY_BYTES) in error["message"]


def test_request_ids_are_passed_on_or_made_up(gateway: GatewayServer) -> None:
    url = f"{gateway.base_url}/v1/completions"
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    mine = loopback.post(url, json=body, headers={"x-request-id": "batch-7 line 3"}, timeout=60)
    assert mine.status_code == 200 and mine.headers["x-request-id"] == "batch-7 line 3"
    made = [loopback.post(url, json=body, timeout=60).headers["x-request-id"] for _ in range(2)]
    assert made[0] != made[1] and all(len(i) == 16 for i in made)
    bad = loopback.post(url, json=body, headers={"x-request-id": b"caf\xe9"}, timeout=60)
    assert bad.status_code == 200 and len(bad.headers["x-request-id"]) == 16  # made up


def test_unknown_model_404_lists_served_models(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4", messages=PARIS)
    assert caught.value.body["code"] == "model_not_found"
    assert MODEL in caught.value.body["message"]
    assert [m.id for m in client.models.list()] == [MODEL]


def test_no_ready_replica_and_draining_answer_503(
    client: openai.OpenAI, gateway: GatewayServer
) -> None:
    gateway.replicas.upsert(Replica("cold-1", "w-cold", "cold", "cpu:0", "http://127.0.0.1:9"))
    try:
        with pytest.raises(openai.InternalServerError) as caught:
            client.chat.completions.create(model="cold", messages=PARIS)
        assert caught.value.status_code == 503
        assert caught.value.response.headers["retry-after"] == "1"
    finally:
        gateway.replicas.remove("cold-1")
    gateway.state.draining = True
    try:
        with pytest.raises(openai.InternalServerError) as caught:
            client.chat.completions.create(model=MODEL, messages=PARIS)
        assert caught.value.body["code"] == "service_unavailable"
    finally:
        gateway.state.draining = False


def test_health_says_503_while_every_replica_is_out_of_routing(gateway: GatewayServer) -> None:
    """Issue 32: a stopped worker's replica, ejected by its health checks, left ``/readyz``
    (and ``/health``) at 200 until liveness killed it, 16 s later by default. Ready means a
    replica the gateway would route to."""
    replica = gateway.replicas.get("r1")
    assert replica is not None and replica.ready
    url = gateway.base_url + "/health"
    assert loopback.get(url, timeout=30).status_code == 200
    replica.ejected = "2 health probes in a row failed"
    try:
        assert loopback.get(url, timeout=30).status_code == 503
    finally:
        replica.ejected = None
    assert loopback.get(url, timeout=30).status_code == 200


def test_full_queue_answers_429_with_retry_after(
    client: openai.OpenAI, gateway: GatewayServer
) -> None:
    replica = gateway.replicas.get("r1")
    replica.max_queue = 1
    try:
        with client.completions.create(
            model=MODEL,
            prompt="Count:",
            max_tokens=200,
            stream=True,
            extra_body={"ignore_eos": True},
        ) as stream:
            next(iter(stream))
            with pytest.raises(openai.RateLimitError) as caught:
                client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        # from the model's drain rate (unit-tested in test_admission): whole seconds >= 1
        assert int(caught.value.response.headers["retry-after"]) >= 1
        assert caught.value.body["code"] == "rate_limit_exceeded"
    finally:
        replica.max_queue = 64
    assert wait_until(lambda: replica.in_flight == 0)


def test_requests_beyond_max_num_seqs_wait_in_the_gateway_and_leave_when_clients_do(
    client: openai.OpenAI, gateway: GatewayServer, worker: WorkerProcess
) -> None:
    replica, admission = gateway.replicas.get("r1"), gateway.state.admission
    replica.max_num_seqs = 1
    url = f"{gateway.base_url}/v1/completions"
    try:
        with client.completions.create(
            model=MODEL,
            prompt="Count:",
            max_tokens=400,
            stream=True,
            extra_body={"ignore_eos": True},
        ) as stream:
            next(iter(stream))
            with ThreadPoolExecutor(1) as pool:
                body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
                queued = pool.submit(loopback.post, url, json=body, timeout=3.0)
                assert wait_until(lambda: admission.num_waiting() == 1)
                assert worker.stats()["num_unfinished_requests"] == 1  # it waits here
                assert replica.in_flight == 1
                with pytest.raises(httpx.ReadTimeout):
                    queued.result()  # the client gives up while queued ...
            assert wait_until(lambda: admission.num_waiting() == 0)  # ... and leaves the queue
            assert replica.in_flight == 1
    finally:
        replica.max_num_seqs = 8
    assert wait_until(lambda: replica.in_flight == 0 and replica.outstanding_tokens == 0)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices


def test_client_disconnect_aborts_generation(
    client: openai.OpenAI, gateway: GatewayServer, worker: WorkerProcess
) -> None:
    with client.chat.completions.create(
        model=MODEL, messages=PARIS, max_tokens=300, stream=True, extra_body={"ignore_eos": True}
    ) as stream:
        next(iter(stream))
        assert worker.stats()["num_unfinished_requests"] == 1
    # leaving the block closed the connection: the worker aborts and frees the blocks

    def all_free() -> bool:
        stats = worker.stats()
        return stats["num_unfinished_requests"] == 0 and (
            stats["num_blocks_free"] == stats["num_blocks_total"]
        )

    assert wait_until(all_free, 3.0), worker.stats()
    assert gateway.replicas.get("r1").in_flight == 0


def test_worker_killed_mid_request_ends_with_error(
    gateway: GatewayServer, client: openai.OpenAI, start_worker: Callable[[str], WorkerProcess]
) -> None:
    doomed = start_worker("doomed")
    replica = Replica("doomed-1", "w-doomed", "doomed", "cpu:0", doomed.base_url, ready=True)
    gateway.replicas.upsert(replica)
    body = {"model": "doomed", "prompt": "Count:", "max_tokens": 300, "stream": True,
            "ignore_eos": True}  # fmt: skip
    url = f"{gateway.base_url}/v1/completions"
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(loopback.post, url, json={**body, "stream": False}, timeout=60)
            with loopback.stream("POST", url, json=body, timeout=60) as response:
                events = sse_events(response)
                assert "choices" in json.loads(next(events))
                assert wait_until(lambda: doomed.stats()["num_unfinished_requests"] == 2)
                os.kill(doomed.process.pid, signal.SIGKILL)
                rest = list(events)
            not_streamed = waiting.result()
        assert not_streamed.status_code == 502
        assert not_streamed.headers["x-kunlun-device"] == "cpu:0"  # errors name the device too
        assert not_streamed.json()["error"]["code"] == "worker_died"
        assert rest and "[DONE]" not in rest
        error = json.loads(rest[-1])["error"]
        assert error["code"] == "worker_died" and error["type"] == "server_error"
        assert "stopped" in error["message"]
        assert wait_until(lambda: replica.in_flight == 0)
        # the dead worker's next request: 503 (not reachable), and the gateway serves on
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model="doomed", prompt="Hi", max_tokens=2)
        assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices
    finally:
        gateway.replicas.remove("doomed-1")


def test_32_concurrent_streams_complete(client: openai.OpenAI, gateway: GatewayServer) -> None:
    def one(i: int) -> str | None:
        stream = client.completions.create(
            model=MODEL, prompt=f"Number {i}:", max_tokens=3, stream=True, temperature=0
        )
        return [c.choices[0].finish_reason for c in stream][-1]

    with ThreadPoolExecutor(32) as pool:
        reasons = list(pool.map(one, range(32)))
    assert all(r in ("length", "stop") for r in reasons), reasons
    # the slot is given back just after the last byte is sent: the client may see it first
    assert wait_until(lambda: gateway.replicas.get("r1").in_flight == 0)


EVENT = b'data: {"choices": [{"index": 0, "text": "hi"}]}\n\n'
DONE = b"data: [DONE]\n\n"


class RawWorker:
    """A worker on loopback that answers every request with the same streamed body: each of
    ``pieces`` as one HTTP chunk, then, ``pause_s`` later, the end of the chunked body, or
    (``cut``) a closed connection instead, as a worker that dies does."""

    def __init__(self, pieces: tuple[bytes, ...], pause_s: float = 0.0, cut: bool = False) -> None:
        self.pieces, self.pause_s, self.cut = pieces, pause_s, cut
        self.server = socket.create_server(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(65536)
            head, body = request.split(b"\r\n\r\n", 1)
            length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
            while len(body) < length:
                body += conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
            for piece in self.pieces:
                conn.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                time.sleep(0.05)  # each its own read at the gateway
            time.sleep(self.pause_s)
            with contextlib.suppress(OSError):
                if not self.cut:
                    conn.sendall(b"0\r\n\r\n")

    def close(self) -> None:
        self.server.close()


def test_a_client_that_closes_on_done_is_counted_200() -> None:
    """The openai SDK closes a stream on ``[DONE]``, maybe before the gateway has the end of
    the chunked body: the client has its whole answer, so the exchange is a 200, not a 499.
    (The worker's last write, the end of the body, comes a second late: a loaded worker's
    last write can reach the gateway in a read of its own.)"""
    worker = RawWorker((EVENT, DONE), pause_s=1.0)
    try:
        with gateway_over(worker.base_url) as gateway:
            client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="x", max_retries=0)
            for _ in range(3):
                stream = client.completions.create(model=MODEL, prompt="Hi", stream=True)
                assert [c.choices[0].text for c in stream] == ["hi"]
                stream.close()  # on [DONE], a second before the worker's end of body
            metrics = gateway.state.metrics  # type: ignore[attr-defined]

            def counted(status: str) -> float:
                value = metrics.registry.get_sample_value(
                    "kunlun_requests_total",
                    {"model": MODEL, "replica": "r1", "priority": "normal", "status": status},
                )
                return value or 0.0

            assert wait_until(lambda: counted("200") + counted("499") == 3, 10.0)
            assert (counted("200"), counted("499")) == (3, 0)
            assert wait_until(lambda: gateway.replicas.get("r1").in_flight == 0)
    finally:
        worker.close()


def test_a_worker_that_dies_mid_event_leaves_the_client_whole_events_and_the_error() -> None:
    """Events reach the client whole: one split over two of the worker's writes arrives as
    one event, and a worker that dies halfway through writing one (its connection closes)
    leaves the client the events before it and the error event, not a line of broken JSON
    (which the openai SDK fails to parse)."""
    split = EVENT[:20], EVENT[20:] + DONE
    for pieces, cut in (((EVENT, split[0]), True), (split, False)):
        worker = RawWorker(pieces, cut=cut)
        try:
            with gateway_over(worker.base_url) as gateway:
                client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="x",
                                       max_retries=0)  # fmt: skip
                texts = []
                if cut:
                    with pytest.raises(openai.APIError) as raised:
                        for chunk in client.completions.create(
                            model=MODEL, prompt="Hi", stream=True
                        ):
                            texts.append(chunk.choices[0].text)
                    assert raised.value.body["code"] == "worker_died", raised.value.body  # type: ignore[index]
                    assert "cut off" in raised.value.message
                    raw = loopback.post(f"{gateway.base_url}/v1/completions", timeout=30,
                                        json={"model": MODEL, "prompt": "Hi", "stream": True})  # fmt: skip
                    assert raw.content.startswith(EVENT) and raw.content.count(b"data: ") == 2
                    assert (
                        json.loads(raw.content[len(EVENT) + 6 :])["error"]["code"] == "worker_died"
                    )
                else:
                    stream = client.completions.create(model=MODEL, prompt="Hi", stream=True)
                    texts = [chunk.choices[0].text for chunk in stream]
                assert texts == ["hi"]
        finally:
            worker.close()


def test_a_stream_that_ends_inside_an_event_reaches_the_client_whole() -> None:
    """Held back until its end, an event the body ends inside (no blank line after it) still
    reaches the client when the worker ends the body normally: nothing the worker sent is
    lost."""
    tail = b"data: [DONE]"
    worker = RawWorker((EVENT, tail), pause_s=0.2)  # the body's end in a read of its own
    try:
        with gateway_over(worker.base_url) as gateway:
            raw = loopback.post(f"{gateway.base_url}/v1/completions", timeout=30,
                                json={"model": MODEL, "prompt": "Hi", "stream": True})  # fmt: skip
            assert raw.status_code == 200 and raw.content == EVENT + tail, raw.content
    finally:
        worker.close()
