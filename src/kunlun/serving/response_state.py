"""The Responses API's kept answers: ``store`` and ``previous_response_id``, at the gateway.

A worker answers ``POST /v1/responses`` statelessly (:mod:`kunlun.serving.responses_api`):
it sees the whole conversation in ``input``. The gateway gives the API its state, in the
daemon's state store (SQLite on one node, etcd on a cluster, so any node may continue a
conversation another answered):

- **Continuing** (:meth:`ResponseState.prepare`): a request naming ``previous_response_id``
  has the kept conversation (every input item and output item up to and including that
  response) put before its own ``input``, and the field taken out, before it is admitted;
  the worker echoes the id (``X-Kunlun-Previous-Response``). ``instructions`` are not
  carried over, as OpenAI's API does not carry them. An id that is not kept is a 400 naming
  ``previous_response_id``.
- **Keeping** (:class:`Recorder`): unless the request says ``store: false``, the answer the
  worker relays (the JSON object, or the last event of a stream) is read
  as it passes and, when it is a 200, the conversation with its output is kept under the
  response's id, written off the event loop before the answer's last bytes are sent (a
  client may continue the moment it has the answer). A conversation of more than
  :data:`KEPT_BYTES` is not kept (said once in the daemon's log); kept ones go after
  :data:`KEEP_S`.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from kunlun import json_text
from kunlun.errors import RequestError
from kunlun.protocol.openai_errors import param_error
from kunlun.state.store import ResponseRecord, StateStore

RESPONSES_PATH = "/v1/responses"
KEEP_S = 30 * 24 * 3600.0
"""How long a kept response can be continued (OpenAI keeps them 30 days)."""
KEPT_BYTES = 16 << 20
"""The largest conversation kept: the request relayed and its answer, in bytes."""
PRUNE_EVERY_S = 600.0
"""How often keeping a response also forgets those older than :data:`KEEP_S`."""
_ENDS = (b"event: response.completed", b"event: response.incomplete")
"""The events a stream ends with, each carrying the whole response."""


class ResponseNotFound(RequestError):
    """No response with the id a request names is kept."""

    code = "serving.response_not_found"
    openai_code = "not_found"
    http_status = 404
    openai_type = "invalid_request_error"


class ResponseState:
    """Kept responses in ``store`` (see the module docstring)."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self._pruned = 0.0
        self._said: set[str] = set()

    async def prepare(self, body: bytes) -> tuple[bytes, str | None, Recorder | None]:
        """The body to relay (``previous_response_id`` resolved), the id it continues and
        the recorder of its answer (None with ``store: false``); a 400 naming the field
        when the id is not kept. A body that is not a JSON object is left to the refusals
        of admission and the worker."""
        payload = json_text.loads(body)
        if not isinstance(payload, dict):
            return body, None, None
        previous = payload.get("previous_response_id")
        items = _input_items(payload.get("input"))
        if previous is not None:
            if not isinstance(previous, str) or items is None:
                return body, None, None  # the worker names what is wrong with it
            kept = await asyncio.to_thread(self.store.get_response, previous)
            if kept is None:
                raise param_error("previous_response_id", f"no response {previous!r} is kept "
                                  "here: it was not answered by this platform, was made with "
                                  f"store: false, is older than {KEEP_S / 86400:g} days or its "
                                  f"conversation was over {KEPT_BYTES >> 20} MiB")  # fmt: skip
            items = kept.items + items
            payload = {k: v for k, v in payload.items() if k != "previous_response_id"}
            payload["input"] = items
            body = await asyncio.to_thread(_encode, payload)  # a kept conversation: MiBs
        if payload.get("store") is False or items is None:
            return body, previous, None
        return body, previous, Recorder(self, items, str(payload.get("model", "")), len(body))

    async def keep(self, record: ResponseRecord) -> None:
        """Write ``record`` (in a thread); a failure is said once, never raised: the answer
        is the client's whatever happens to its copy."""
        try:
            await asyncio.to_thread(self._write, record)
        except Exception as exc:  # noqa: BLE001 - a store that fails must not fail the answer
            self.say(f"a response could not be kept: {exc!r}")

    def _write(self, record: ResponseRecord) -> None:
        self.store.put_response(record)
        now = time.time()
        if now - self._pruned > PRUNE_EVERY_S:
            self._pruned = now
            self.store.delete_responses_before(now - KEEP_S)

    async def retrieve(self, response_id: str) -> dict[str, Any]:
        """A kept response object (``GET /v1/responses/{id}``), or a 404 naming the id."""
        kept = await asyncio.to_thread(self.store.get_response, response_id)
        if kept is None or not kept.response:
            raise ResponseNotFound(f"no response {response_id!r} is kept here")
        return kept.response

    async def delete(self, response_id: str) -> dict[str, Any]:
        """Forget a kept response (``DELETE /v1/responses/{id}``), or a 404 naming the id."""
        if not await asyncio.to_thread(self.store.delete_response, response_id):
            raise ResponseNotFound(f"no response {response_id!r} is kept here")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def say(self, line: str) -> None:
        """Print ``line`` to the daemon's log, once."""
        if line not in self._said:
            self._said.add(line)
            print(f"responses: {line}", flush=True)


class Recorder:
    """Reads one relayed answer (:meth:`feed`) and keeps its conversation (:meth:`finish`)."""

    def __init__(
        self, state: ResponseState, items: list[dict[str, Any]], model: str, asked: int
    ) -> None:
        """``asked``: the bytes of the request relayed, the conversation's input part."""
        self.state, self.items, self.model = state, items, model
        self.chunks: list[bytes] = []
        self.size = asked

    def feed(self, chunk: bytes) -> None:
        if self.size <= KEPT_BYTES:
            self.size += len(chunk)
            self.chunks.append(chunk)

    async def finish(self, status: int) -> None:
        """The answer ended with ``status``: keep its conversation when it is a whole 200
        (before its last bytes go to the client, so that it may continue at once)."""
        if status != 200:
            return
        if self.size > KEPT_BYTES:
            self.state.say(f"a conversation of more than {KEPT_BYTES >> 20} MiB was not kept")
            return
        response = await asyncio.to_thread(_answer, b"".join(self.chunks))  # up to MiBs
        if response is None or not isinstance(response.get("id"), str):
            return
        output = [item for item in response.get("output") or [] if isinstance(item, dict)]
        await self.state.keep(ResponseRecord(response["id"], self.model, time.time(),
                                             self.items + output, response))  # fmt: skip


def _encode(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, ensure_ascii=False).encode()


def _input_items(given: Any) -> list[dict[str, Any]] | None:
    """A request's ``input`` as items (a string is one user message); None when it is
    neither (the worker refuses it)."""
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    if isinstance(given, list) and all(isinstance(item, dict) for item in given):
        return list(given)
    return None


def _answer(raw: bytes) -> dict[str, Any] | None:
    """The response object of a relayed answer: the JSON body, or the ``response`` of a
    stream's last event (``response.completed``, or ``response.incomplete`` when cut)."""
    try:
        if raw.lstrip().startswith(b"{"):
            found = json.loads(raw)
            return found if isinstance(found, dict) else None
        at = max(raw.rfind(end) for end in _ENDS)
        if at < 0:
            return None
        event = raw[at:].split(b"\n\n", 1)[0]
        data = b"".join(
            line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")
        )
        found = json.loads(data).get("response")
        return found if isinstance(found, dict) else None
    except (ValueError, AttributeError):
        return None
