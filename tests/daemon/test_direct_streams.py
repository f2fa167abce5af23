"""Direct streams (:mod:`kunlun.serving.handoff`): a worker on the daemon's node writes a
streamed answer to the client's connection itself, and the connection stays the daemon's.
Through the real daemon and worker serving the tiny model, read at the byte level from one
kept-alive socket, and through the real ``openai`` SDK."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import stat
import time
from typing import Any

import openai
from tests import loopback
from tests.daemons import TINY, Daemon, Daemons, Profile

from kunlun.serving.handoff import DirectLink

DIRECT = re.compile(r'^kunlun_direct_streams_total\{model="tiny",[^}]*\} (\S+)$', re.M)
LEFT = re.compile(r'^kunlun_requests_total\{model="tiny",[^}]*status="499"\} (\S+)$', re.M)


def count(daemon: Daemon, series: re.Pattern[str] = DIRECT) -> float:
    """A counter of the tiny model in the daemon's ``/metrics``, over its replicas: its direct
    streams, or its requests whose client left first (``LEFT``)."""
    return sum(map(float, series.findall(daemon.get("/metrics").text)))


def connect(daemon: Daemon) -> socket.socket:
    host, port = daemon.url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=60)


class Conn:
    """One HTTP/1.1 connection, read byte by byte: an answer must end exactly where its
    framing says, or the next answer on the connection would not parse."""

    def __init__(self, daemon: Daemon) -> None:
        self.sock = connect(daemon)
        self.buffer = b""

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        assert data, "the daemon closed the connection"
        self.buffer += data

    def _line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            self._fill()
        line, self.buffer = self.buffer.split(b"\r\n", 1)
        return line

    def _take(self, n: int) -> bytes:
        while len(self.buffer) < n:
            self._fill()
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out

    def post(self, path: str, body: dict[str, object]) -> tuple[int, dict[str, str], bytes]:
        payload = json.dumps(body).encode()
        self.sock.sendall(
            b"POST %b HTTP/1.1\r\nhost: kunlun\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (path.encode(), len(payload), payload)
        )
        status = int(self._line().split()[1])
        headers = {}
        while line := self._line():
            name, value = line.decode().split(":", 1)
            headers[name.lower()] = value.strip()
        if "content-length" in headers:
            return status, headers, self._take(int(headers["content-length"]))
        assert headers.get("transfer-encoding") == "chunked", headers
        body_bytes = b""
        while size := int(self._line(), 16):
            body_bytes += self._take(size)
            assert self._take(2) == b"\r\n"
        assert self._line() == b""  # the last chunk's end: nothing else follows
        return status, headers, body_bytes


def events(body: bytes) -> list[str]:
    return [e.removeprefix("data: ") for e in body.decode().split("\n\n") if e]


def test_streams_are_written_by_the_worker_and_the_connection_stays_alive(
    tiny_daemon: Daemon,
) -> None:
    before, left = count(tiny_daemon), count(tiny_daemon, LEFT)
    conn = Conn(tiny_daemon)
    stream = {"model": "tiny", "prompt": "Count:", "max_tokens": 12, "ignore_eos": True,
              "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    for _ in range(2):  # two streams, then a whole answer, then a refusal, on one connection
        status, headers, body = conn.post("/v1/completions", stream)
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        assert headers["x-kunlun-replica"] and headers["x-request-id"]
        got = events(body)
        assert got[-1] == "[DONE]"
        assert json.loads(got[-2])["usage"]["completion_tokens"] == 12
        assert len(got) >= 3
    status, headers, body = conn.post("/v1/completions", {**stream, "stream": False})
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 12
    status, _, body = conn.post("/v1/completions", {**stream, "temperature": -1})
    assert status == 400 and json.loads(body)["error"]["param"] == "temperature"
    assert count(tiny_daemon) - before == 2  # the refused stream was relayed
    chat = openai.OpenAI(base_url=tiny_daemon.url + "/v1", api_key="-", max_retries=0)
    pieces = chat.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    usage = [p.usage for p in pieces if p.usage is not None]
    assert usage[0].completion_tokens == 6
    assert count(tiny_daemon) - before == 3
    # the SDK closes its connection on [DONE]: a whole answer, not a client that left first
    assert count(tiny_daemon, LEFT) == left


class _Held:
    """A connection's socket where the gateway would find it (its transport)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def get_extra_info(self, name: str) -> Any:
        return self.sock if name == "socket" else None


def _handed_over(address: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, bytes]:
    """A completion handed to the worker's direct-stream socket as its daemon would hand it:
    the answer's status and body."""

    async def main() -> tuple[int, bytes]:
        client, _ = socket.socketpair()
        body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1}).encode()
        link = await DirectLink.open(address, _Held(client), "/v1/completions",
                                     [(b"content-type", b"application/json"), *headers],
                                     body, 30, 60)  # fmt: skip
        try:
            status, _, direct = await link.start(60)
            assert not direct  # a whole answer: relayed
            return status, b"".join([piece async for piece in link.pieces()])
        finally:
            link.close()
            client.close()

    return asyncio.run(main())


def test_a_worker_answers_its_own_daemon_only(tiny_daemon: Daemon) -> None:
    """Its port and its direct-stream socket take a request only with the key of its start,
    which its daemon alone was given: no other local process reaches the model past the
    daemon's API keys."""
    assert tiny_daemon.job is not None
    (replica,) = tiny_daemon.describe(tiny_daemon.job)["replicas"]
    worker, address = replica["base_url"], replica["startup"]["handoff"]
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    for headers in ({}, {"X-Kunlun-Worker-Key": "k" * 43}):
        refused = loopback.post(worker + "/v1/completions", json=body, headers=headers, timeout=60)
        assert refused.status_code == 401, refused.text
        assert "no valid X-Kunlun-Worker-Key" in refused.json()["error"]["message"]
        assert loopback.get(worker + "/metrics", headers=headers).status_code == 401
        status, answer = _handed_over(address, [(k.lower().encode(), v.encode())
                                                for k, v in headers.items()])  # fmt: skip
        assert status == 401 and b"X-Kunlun-Worker-Key" in answer, answer
    # the key: in this start's launch file, which only its owner may read; shown nowhere
    launch = tiny_daemon.home / "run" / "workers" / f"{replica['replica_id']}.launch.json"
    assert stat.S_IMODE(launch.stat().st_mode) == 0o600
    given = tiny_daemon.worker_key(replica["replica_id"])
    key = given["X-Kunlun-Worker-Key"]
    assert len(key) >= 40
    assert loopback.post(worker + "/v1/completions", json=body, headers=given,
                         timeout=60).status_code == 200  # fmt: skip
    assert _handed_over(address, [(b"x-kunlun-worker-key", key.encode())])[0] == 200
    shown = [json.dumps(tiny_daemon.describe(tiny_daemon.job)), tiny_daemon.log(),
             tiny_daemon.cli("workload", "logs", tiny_daemon.job).stdout]  # fmt: skip
    assert not any(key in text for text in shown)
    # through the daemon, with no key of the client's
    assert loopback.post(tiny_daemon.url + "/v1/completions", json=body,
                         timeout=60).status_code == 200  # fmt: skip


KEEP_ALIVE_S = 5.0
"""How long the daemon keeps an idle client connection open (uvicorn's default)."""
RELAYED = Profile("relayed-streams-home", (TINY,), args=("--no-direct-streams",))
SILENT = Profile(
    "silent-worker-home",
    (TINY.replace("max_model_len: 1024", "max_model_len: 2048"),),
    env=(("KUNLUN_UPSTREAM_READ_TIMEOUT_S", "1.5"),),
    args=("--worker-answer-deadline-s", "600"),
)


def test_with_direct_streams_off_the_gateway_relays_them(daemons: Daemons) -> None:
    with daemons.serve(RELAYED) as daemon:
        conn = Conn(daemon)
        body = {"model": "tiny", "prompt": "Count:", "max_tokens": 5, "ignore_eos": True,
                "stream": True}  # fmt: skip
        for _ in range(2):
            status, _, answer = conn.post("/v1/completions", body)
            assert status == 200 and events(answer)[-1] == "[DONE]"
        assert count(daemon) == 0


def test_a_worker_silent_past_the_read_timeout_ends_the_stream_and_writes_no_more(
    daemons: Daemons,
) -> None:
    with daemons.serve(SILENT) as daemon:
        assert daemon.job is not None
        pid = int(daemon.describe(daemon.job)["replicas"][0]["pid"])
        sock = connect(daemon)
        payload = json.dumps({"model": "tiny", "prompt": "Count:", "max_tokens": 2000,
                              "ignore_eos": True, "stream": True}).encode()  # fmt: skip
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: k\r\ncontent-type: "
                     b"application/json\r\ncontent-length: %d\r\n\r\n%b"
                     % (len(payload), payload))  # fmt: skip
        received = sock.recv(65536)
        assert b" 200 " in received.split(b"\r\n", 1)[0]
        os.kill(pid, signal.SIGSTOP)  # silent from now on, holding the client's connection
        try:
            deadline = time.monotonic() + 60
            while not received.endswith(b"0\r\n\r\n"):
                assert time.monotonic() < deadline, received[-300:]
                data = sock.recv(65536)
                assert data, received[-300:]
                received += data
        finally:
            os.kill(pid, signal.SIGCONT)  # it wakes: its next write must not reach the client
        assert b"upstream read timeout" in received and b"[DONE]" not in received
        # shut down with its last chunk (well before the daemon's 5 s keep-alive timeout
        # would close an idle connection): nothing the woken worker writes can follow it
        sock.settimeout(KEEP_ALIVE_S / 2)
        assert sock.recv(65536) == b""
        sock.close()


def test_a_stream_the_engine_thread_writes_reads_as_the_whole_answer(tiny_daemon: Daemon) -> None:
    """A plain direct stream's events after its first are written by the worker's engine
    thread: the same id, time and model throughout, the chat's role in its first event only,
    the finish reason on its last, and text and usage that add up to the answer not
    streamed."""
    conn = Conn(tiny_daemon)
    for path, body in (
        ("/v1/completions", {"model": "tiny", "prompt": "Count:", "max_tokens": 60}),
        ("/v1/chat/completions", {"model": "tiny", "max_tokens": 60,
                                  "messages": [{"role": "user", "content": "hi"}]}),
    ):  # fmt: skip
        body = {**body, "ignore_eos": True, "temperature": 0}
        status, _, whole = conn.post(path, body)
        assert status == 200
        answer = json.loads(whole)
        status, _, streamed = conn.post(
            path, {**body, "stream": True, "stream_options": {"include_usage": True}}
        )
        assert status == 200
        chunks = [json.loads(e) for e in events(streamed)[:-1]]
        assert len({(c["id"], c["created"], c["model"], c["object"]) for c in chunks}) == 1
        choices = [c["choices"][0] for c in chunks if c["choices"]]
        if path == "/v1/completions":
            text, want = "".join(c["text"] for c in choices), answer["choices"][0]["text"]
        else:
            assert choices[0]["delta"]["role"] == "assistant"
            assert not any("role" in c["delta"] for c in choices[1:])
            text = "".join(c["delta"]["content"] or "" for c in choices)
            want = answer["choices"][0]["message"]["content"]
        assert text == want
        assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
        usage = chunks[-1]["usage"]  # (the second asking finds its prompt in the cache)
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert usage[key] == answer["usage"][key]
        assert usage["completion_tokens"] == 60
        # at most one a token; fewer where deltas waited for the event loop and were merged
        # (before the engine thread took the stream over, or when the connection was full)
        assert 2 <= len(choices) <= 60
