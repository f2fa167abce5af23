"""The gateway's end of a direct stream (:class:`kunlun.serving.handoff.DirectLink`) reading
the worker's frames over a real socket pair: a wait cancelled halfway through a frame loses
nothing, and an end that arrived unread is found without waiting."""

from __future__ import annotations

import asyncio
import json
import socket

from kunlun.serving.handoff import END, HEAD, PROGRESS, DirectLink


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
