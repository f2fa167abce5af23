"""The gateway's end of a direct stream (:class:`kunlun.serving.handoff.DirectLink`) reading
the worker's frames over a real socket pair: a wait cancelled halfway through a frame loses
nothing, and an end that arrived unread is found without waiting. And a worker process (the
real hand-off server) killed while its client's connection holds part of a chunk: the
client gets a cut body, never the gateway's error event spliced into that chunk."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.serving.conftest import MODEL, gateway_over

from kunlun.serving.handoff import END, HEAD, INSIDE_CHUNK, PROGRESS, WHOLE, DirectLink


def frame(kind: bytes, payload: bytes = b"") -> bytes:
    return HEAD.pack(kind, len(payload)) + payload


def test_a_wait_cancelled_inside_a_frame_leaves_it_whole() -> None:
    async def main() -> tuple[bytes, bytes]:
        gateway, worker = socket.socketpair()
        gateway.setblocking(False)
        link = DirectLink(gateway)
        end = frame(END, json.dumps({"first_byte": 1.5}).encode())
        worker.send(end[: HEAD.size + 3])  # the head and part of the payload
        waiting = asyncio.ensure_future(link.frame())
        await asyncio.sleep(0.05)
        assert not waiting.done()
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        worker.send(end[HEAD.size + 3 :])
        try:
            return await asyncio.wait_for(link.frame(), 10)
        finally:
            link.close()
            worker.close()

    kind, payload = asyncio.run(main())
    assert kind == END and json.loads(payload) == {"first_byte": 1.5}


def test_an_end_already_arrived_is_read_without_waiting() -> None:
    gateway, worker = socket.socketpair()
    gateway.setblocking(False)
    link = DirectLink(gateway)
    try:
        assert link.end_if_here() is None  # nothing yet
        end = frame(END, b'{"error_event": false}')
        worker.send(frame(PROGRESS) + end[:4])
        assert link.end_if_here() is None  # a progress frame, then part of the end
        worker.send(end[4:])
        assert link.end_if_here() == {"error_event": False}
    finally:
        link.close()
        worker.close()


def _largest_send_buffer() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except (OSError, ValueError, IndexError):
        return 4 << 20  # Linux's default


BIG = 2 * _largest_send_buffer()
"""An event larger than any send buffer the kernel grows, with a client whose receive
buffer is held small: the worker's connection takes it only in part while the client does
not read."""
WORKER = f"""
import asyncio, sys
from kunlun.serving.handoff_worker import HandoffServer

async def app(scope, receive, send):
    await receive()
    await send({{"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]}})
    await send({{"type": "http.response.body", "body": b'data: {{"n": 1}}\\n\\n', "more_body": True}})
    big = b'data: {{"x": "' + b"a" * {BIG} + b'"}}\\n\\n'
    await send({{"type": "http.response.body", "body": big, "more_body": True}})
    await asyncio.sleep(3600)

async def main():
    server = HandoffServer(app, lambda line: print(line, file=sys.stderr, flush=True))
    server.start()
    print(server.address, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_a_worker_killed_inside_a_chunk_leaves_the_client_a_cut_body() -> None:
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE)
    try:
        assert worker.stdout is not None
        address = worker.stdout.readline().decode().strip()
        assert address, "the worker did not start"
        with gateway_over("http://127.0.0.1:9", handoff=address) as gateway:
            host, port = gateway.base_url.removeprefix("http://").rsplit(":", 1)
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)  # no autotuning
            sock.settimeout(30)
            sock.connect((host, int(port)))
            payload = json.dumps({"model": MODEL, "prompt": "Hi", "stream": True}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: k\r\ncontent-type: "
                         b"application/json\r\ncontent-length: %d\r\n\r\n%b"
                         % (len(payload), payload))  # fmt: skip
            received = b""
            while b'{"n": 1}' not in received:  # the head and the first, whole event
                data = sock.recv(65536)
                assert data, received
                received += data
            time.sleep(0.5)  # the worker writes what the connection takes of the big event
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait(30)
            while data := sock.recv(1 << 20):  # to the connection's end (a 30 s timeout)
                received += data
            sock.close()
    finally:
        worker.kill()
        worker.wait(30)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    first = b'data: {"n": 1}\n\n'
    assert body.startswith(b"%x\r\n%b\r\n" % (len(first), first))
    cut = body[len(first) + 6 :]
    size_line, _, part = cut.partition(b"\r\n")
    assert int(size_line, 16) == len(b'data: {"x": ""}\n\n') + BIG
    # part of the big event, then the end: no error event or last chunk spliced into it
    assert 0 < len(part) < BIG and part.startswith(b'data: {"x": "aaa')
    assert part.strip(b"a") == b'data: {"x": "', part[-200:]


def test_pieces_the_engine_thread_writes_and_the_loops_arrive_whole_and_in_order() -> None:
    """``_Exchange.write_now`` from another thread (the engine's) between the event loop's
    pieces: while the client does not read, the connection fills and the engine thread's
    writing stops (a piece refused, or taken in part); the event loop then writes the rest of
    a part-taken chunk before its own piece. Every chunk reaches the client whole and in
    order, and the engine thread's writing tells the gateway the answer is alive."""
    from kunlun.serving.handoff_worker import _chunk, _Exchange

    pieces = [b"data: %d %s\n\n" % (i, b"x" * 5000) for i in range(100)]

    async def main() -> tuple[bytes, int, list[bytes], int]:
        listener = socket.create_server(("127.0.0.1", 0))
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(listener.getsockname())
        served, _ = listener.accept()
        listener.close()
        served.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        served.setblocking(False)
        gateway, worker = socket.socketpair()
        worker.setblocking(False)
        link = bytearray()  # what the gateway reads of the worker's frames, as it goes

        def listen() -> None:
            while data := gateway.recv(65536):
                link.extend(data)

        listening = threading.Thread(target=listen, daemon=True)
        listening.start()
        exchange = _Exchange(worker, served, app=None)  # type: ignore[arg-type]
        exchange.direct, exchange.progress_s = True, 0.0
        exchange.go.set_result(None)
        body = {"type": "http.response.body", "more_body": True}
        await exchange._send({**body, "body": pieces[0]})
        taken: list[bytes] = []

        def engine() -> None:
            for piece in pieces[1:]:
                if not exchange.write_now(piece):
                    return
                taken.append(piece)
            raise AssertionError("the connection took every piece: nothing was left to test")

        thread = threading.Thread(target=engine)
        thread.start()
        thread.join()
        left = len(exchange.rest)  # of a piece the connection took only in part
        received = bytearray()

        def read() -> None:
            want = sum(len(_chunk(p)) for p in pieces)
            while len(received) < want:
                data = client.recv(65536)
                if not data:
                    return
                received.extend(data)

        reader = threading.Thread(target=read)
        reader.start()
        for piece in pieces[1 + len(taken) :]:
            await exchange._send({**body, "body": piece})
        await asyncio.get_running_loop().run_in_executor(None, reader.join, 60)
        worker.close()
        await asyncio.get_running_loop().run_in_executor(None, listening.join, 60)
        frames = []
        while link:
            kind, length = HEAD.unpack(link[: HEAD.size])
            frames.append(kind)
            del link[: HEAD.size + length]
        for sock in (client, served, gateway):
            sock.close()
        return bytes(received), len(taken), frames, left

    received, taken, frames, left = asyncio.run(main())
    assert received == b"".join(_chunk(p) for p in pieces)
    assert 0 < taken < len(pieces) - 1  # the engine thread wrote some, then the loop
    assert left > 0  # its last piece in part: the loop wrote the rest of it first
    assert INSIDE_CHUNK in frames and WHOLE in frames  # around that rest
    assert PROGRESS in frames  # sent by the engine thread's writing too
