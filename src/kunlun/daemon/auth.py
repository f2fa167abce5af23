"""The daemon's API-key check: who the caller is, what the key may do, and how often.

Once any active key exists, every route but :data:`OPEN_PATHS` needs one
(``Authorization: Bearer <key>`` or ``X-API-Key``). :class:`ApiKeyMiddleware` answers, in
this order and in the OpenAI error shape:

1. 401 when the key is missing or not an active key;
2. 403 naming the client's address when the key has an allow-list that address is not in;
3. 403 naming the scope needed when the route needs ``admin`` (:func:`required_scope`) and
   the key is an ``inference`` key;
4. 429 with ``Retry-After`` when the key has used its requests per minute;

then passes the request on with the key's priority class and, on the inference routes of a
key with a token limit, its :class:`~kunlun.serving.key_limits.TokenCharge` in the scope
(the gateway admits it against its estimate; the charge is settled here from the usage at
the end of the answer).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kunlun.errors import KunlunError, Location, PermissionDenied, RequestError
from kunlun.protocol.openai_errors import AuthenticationError, RateLimited, error_status_and_body
from kunlun.serving.endpoints import PREFIX as ENDPOINT_CALLS
from kunlun.serving.gateway import ENDPOINTS
from kunlun.serving.handoff import relayed_only
from kunlun.serving.key_limits import KEY_TOKENS_SCOPE, KeyLimiter, KeyPolicy, TokenCharge
from kunlun.serving.routing import KEY_PRIORITY_SCOPE
from kunlun.state.api_keys import ActiveKey, KeyRing, masked

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/health", "/ping"})
"""Routes that need no key."""
ADMIN_PREFIX = "/api/v1/"
"""Every route under it needs an ``admin`` key: it changes the platform (workloads, models,
keys) or shows host facts (devices, model paths, worker logs)."""
_TAIL_BYTES = 4096
"""How much of the end of an answer is kept to find its usage."""


def required_scope(path: str) -> str:
    """The scope a route needs: ``admin`` under :data:`ADMIN_PREFIX`, else ``inference``
    (which ``admin`` keys have too)."""
    return "admin" if path.startswith(ADMIN_PREFIX) or path == ADMIN_PREFIX[:-1] else "inference"


class ApiKeyMiddleware:
    """The key check in front of the daemon's routes (see the module docstring)."""

    def __init__(self, app: ASGIApp, keyring: KeyRing, limiter: KeyLimiter) -> None:
        self.app = app
        self.keyring = keyring
        self.limiter = limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or not self.keyring.enabled:
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        address = client[0] if client else None
        presented = [
            (name, value) for name, value in scope["headers"]
            if name in (b"authorization", b"x-api-key")
        ]  # fmt: skip
        if len(presented) > 1:  # which one would count is a guess: refuse, naming them
            names = ", ".join(sorted({n.decode().title() for n, _ in presented}))
            await _refuse(send, RequestError(
                f"{len(presented)} credentials were sent ({names}); send one: "
                "'Authorization: Bearer <key>' or 'X-API-Key: <key>'",
                location=Location("request", field="Authorization"),
            ))  # fmt: skip
            return
        secret = None
        for name, value in presented:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                secret = value[7:].decode("latin-1").strip()
            elif name == b"x-api-key":
                secret = value.decode("latin-1").strip()
        key = self.keyring.lookup(secret)
        wait = None if key is not None or not secret else self.keyring.failures.retry_after(address)
        if wait is not None:  # a valid key always passes: no client locks out its neighbours
            await _refuse(send, RateLimited(
                f"too many wrong API keys from {address}: more than "
                f"{self.keyring.failures.per_minute} a minute", retry_after_s=wait,
            ))  # fmt: skip
            return
        if key is None:
            if secret:
                self.keyring.failures.failed(address)
            message = "missing API key" if not secret else "invalid API key"
            await _refuse(
                send,
                AuthenticationError(f"{message}; send 'Authorization: Bearer <key>'"),
                [(b"www-authenticate", b"Bearer")],
            )
            return
        policy = self.limiter.policy(key)
        charge = None
        try:
            self._admit(key, policy, scope["path"], address)
        except KunlunError as exc:
            await _refuse(send, exc)
            return
        if key.priority is not None:
            scope[KEY_PRIORITY_SCOPE] = key.priority  # the request's class unless its header says
        if policy.tpm is not None and (
            scope["path"] in ENDPOINTS or scope["path"].startswith(ENDPOINT_CALLS)
        ):  # an endpoint call is a chat completion (kunlun.daemon.endpoints_api)
            charge = scope[KEY_TOKENS_SCOPE] = TokenCharge(self.limiter, key, policy.tpm)
        if charge is None:
            await self.app(scope, receive, send)
            return
        relayed_only(scope)  # the charge is settled from the usage at the answer's end
        watch = _AnswerTail(send)
        try:
            await self.app(scope, receive, watch)
        finally:
            charge.settle(watch.status, watch.tail)

    def _admit(self, key: ActiveKey, policy: KeyPolicy, path: str, address: str | None) -> None:
        """Steps 2 to 4 of the module docstring for a valid key: raises the refusal (its
        denial counted against the key) or takes one of the key's requests per minute."""
        if not policy.allows(address):
            self.limiter.deny(key, "ip")
            raise PermissionDenied(
                f"API key {key.name!r} ({key.key_id}) may not be used from "
                f"{address or 'an unknown address'}: not in its allow-list",
                hint="apikey create --allow-ip, or api_keys.allow_ips in "
                "scheduler_config.yaml, says which networks may use a key",
            )
        needed = required_scope(path)
        if needed == "admin" and key.scope != "admin":
            self.limiter.deny(key, "scope")
            raise PermissionDenied(
                f"{masked(path)} needs an API key with scope 'admin'; "
                f"key {key.name!r} "
                f"({key.key_id}) has scope {key.scope!r}",
                hint="kunlun-cli apikey create NAME --scope admin",
            )
        if policy.rpm is not None:
            self.limiter.take_request(key, policy.rpm)


class _AnswerTail:
    """A ``send`` that notes the answer's status and keeps its last bytes."""

    __slots__ = ("send", "status", "tail")

    def __init__(self, send: Send) -> None:
        self.send = send
        self.status: int | None = None
        self.tail = b""

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            body = message.get("body", b"")
            self.tail = (self.tail + body)[-_TAIL_BYTES:] if body else self.tail
        await self.send(message)


async def _refuse(
    send: Send, exc: KunlunError, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    status, body, headers = error_status_and_body(exc)
    raw: list[Any] = [(b"content-type", b"application/json"), *(extra or [])]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})
