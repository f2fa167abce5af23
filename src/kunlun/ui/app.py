"""The ``/ui`` entry: sessions, login and logout, and the daemon calls the pages make.

:class:`Dashboard` wraps the daemon's ASGI app from outside the API-key check: ``/ui``
paths are answered here (a browser carries a session cookie, not a bearer key), all others
pass on untouched. A page reads the daemon through :meth:`Dashboard.api`: an in-process
call to the same app with the session's key and the browser's address, so the key's scope,
allow-list and rate limits apply exactly as they do to ``kunlun-cli``. ``/ui/call/v1/...``
and ``/ui/call/metrics`` forward a browser request (the Playground's streaming chat) the same
way, streamed through unbuffered.

The dashboard rides the app's lifespan: once the daemon has started it starts the Metrics
page's history (:class:`~kunlun.ui.history.MetricsHistory`), and stops it first on shutdown.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from jinja2 import Environment, PackageLoader
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kunlun.errors import KunlunError, PermissionDenied
from kunlun.protocol.openai_errors import AuthenticationError, error_status_and_body
from kunlun.state.api_keys import KeyRing
from kunlun.ui.format import rows, text
from kunlun.ui.history import MetricsHistory
from kunlun.ui.session import COOKIE, Session, Sessions

PREFIX = "/ui"
CALL = "/ui/call"
"""Browser calls forwarded to the daemon with the session's key."""
CALLABLE = ("/v1/", "/metrics")
"""What :data:`CALL` may reach: the inference API and the metrics."""
_DROPPED = frozenset({b"cookie", b"authorization", b"x-api-key"})


class ApiError(Exception):
    """A daemon route's refusal, as the page shows it."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def form_fields(
    form: dict[str, str], fields: tuple[str, ...], whole: frozenset[str], least: int
) -> dict[str, Any]:
    """The filled fields of a page's form (empty ones left out; those of ``whole`` as whole
    numbers of at least ``least``), or :class:`ApiError` naming an unknown or bad field."""
    unknown = sorted(set(form) - set(fields))
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r}", unknown[0])
    out: dict[str, Any] = {}
    for field in fields:
        value = form.get(field, "").strip()
        if not value:
            continue
        if field in whole:
            if not value.isdigit() or int(value) < least:
                raise ApiError(400, f"{field}: must be a whole number of at least {least}, "
                               f"got {value!r}", field)  # fmt: skip
            out[field] = int(value)
        else:
            out[field] = value
    return out


class Dashboard:
    """The daemon's ASGI entry with ``/ui`` in front of ``inner`` (see the module docstring)."""

    def __init__(
        self, inner: ASGIApp, keyring: KeyRing, home: Path, history: MetricsHistory
    ) -> None:
        from kunlun.ui import pages

        self.inner = inner
        self.history = history
        self.keyring = keyring
        self.home = home
        self.sessions = Sessions(home, keyring)
        self.templates = Environment(
            loader=PackageLoader("kunlun.ui", "templates"), autoescape=True
        )
        self.templates.filters["when"] = _when
        self.templates.filters["text"] = text
        self.templates.filters["rows"] = rows
        self.app = Starlette(
            routes=[
                Route("/ui", lambda r: RedirectResponse("/ui/devices", 303)),
                Route("/ui/login", self.login_page, methods=["GET"]),
                Route("/ui/login", self.login, methods=["POST"]),
                Route("/ui/logout", self.logout, methods=["POST"]),
                *pages.routes(self),
                Mount("/ui/static", StaticFiles(packages=[("kunlun.ui", "static")])),
            ]
        )
        self.app.state.dashboard = self

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "lifespan":
            await self.inner(scope, self._on_shutdown(receive), self._on_started(send))
        elif scope["type"] != "http" or not (path == PREFIX or path.startswith(PREFIX + "/")):
            await self.inner(scope, receive, send)
        elif path.startswith(CALL + "/"):
            await self.forward(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    def _on_started(self, send: Send) -> Send:
        async def wrapped(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                self.history.start()
            await send(message)

        return wrapped

    def _on_shutdown(self, receive: Receive) -> Receive:
        async def wrapped() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await self.history.stop()
            return message

        return wrapped

    # -- sessions ---------------------------------------------------------------------------

    def session(self, request: Request) -> Session | None:
        return self.sessions.get(request.cookies.get(COOKIE))

    def render(self, name: str, status: int = 200, **context: Any) -> Response:
        html = self.templates.get_template(name).render(**context)
        headers = {
            "content-security-policy": "default-src 'self'; img-src 'self' data:; "
            "style-src 'self'; script-src 'self'; frame-ancestors 'none'",
            "x-content-type-options": "nosniff",
            "cache-control": "no-store",
        }
        return Response(html, status, headers=headers, media_type="text/html")

    async def login_page(self, request: Request) -> Response:
        return self.login_form()

    def login_form(self, error: str | None = None, status: int = 200) -> Response:
        return self.render("login.html", status, open=not self.keyring.enabled, error=error,
                           session=None)  # fmt: skip

    async def login(self, request: Request) -> Response:
        if not same_origin(request):
            return self.login_form("cross-site login refused", 403)
        form = await request.form()
        unknown = sorted(set(form) - {"key"})
        if unknown:
            return self.login_form(f"unknown field {unknown[0]!r}; the form takes 'key'", 400)
        secret = str(form.get("key") or "").strip()
        if not self.keyring.enabled:
            cookie = self.sessions.open(None, "no keys", "admin")
        elif not secret:
            return self.login_form("key: an API key is required", 400)
        else:
            address = request.client.host if request.client else None
            key = self.keyring.lookup(secret)
            wait = None if key is not None else self.keyring.failures.retry_after(address)
            if wait is not None:
                return self.login_form(
                    f"too many wrong keys from {address}; try again in {wait} s", 429
                )
            if key is None:
                self.keyring.failures.failed(address)
                return self.login_form("key: not an active API key of this daemon", 401)
            cookie = self.sessions.open(secret, key.name, key.scope)
        response = RedirectResponse("/ui/devices", 303)
        response.set_cookie(COOKIE, cookie, max_age=self.sessions.lifetime_s, path=PREFIX,
                            httponly=True, samesite="strict",
                            secure=request.url.scheme == "https")  # fmt: skip
        return response

    async def logout(self, request: Request) -> Response:
        if same_origin(request):
            self.sessions.close(request.cookies.get(COOKIE))
        response = RedirectResponse("/ui/login", 303)
        response.delete_cookie(COOKIE, path=PREFIX)
        return response

    # -- calling the daemon -----------------------------------------------------------------

    async def api(
        self, request: Request, session: Session, method: str, path: str, body: Any = None
    ) -> Any:
        """``method path`` on the daemon as ``session``'s key from the browser's address;
        the JSON answer, or :class:`ApiError` with the daemon's message."""
        client = (request.client.host, request.client.port) if request.client else ("", 0)
        headers = {"authorization": f"Bearer {session.key}"} if session.key else {}
        transport = httpx.ASGITransport(app=self.inner, client=client)
        async with httpx.AsyncClient(transport=transport, base_url="http://kunlun-ui") as http:
            resp = await http.request(method, path, json=body, headers=headers, timeout=60)
        if resp.status_code >= 400:
            error = _error_of(resp)
            raise ApiError(resp.status_code, str(error.get("message")), error.get("param"),
                           error.get("code"))  # fmt: skip
        if resp.headers.get("content-type", "").startswith("application/json"):
            return resp.json()
        return resp.text

    async def forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A browser call under :data:`CALL`, on to the daemon with the session's key."""
        request = Request(scope)
        target = scope["path"][len(CALL) :]
        session = self.session(request)
        if session is None:
            response: Response = _error(AuthenticationError("log in again"))
        elif not _callable(target) or not same_origin(request):
            response = _error(PermissionDenied(f"{target} is not callable from the dashboard"))
        else:
            headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _DROPPED]
            if session.key:
                headers.append((b"authorization", f"Bearer {session.key}".encode()))
            inner = {**scope, "path": target, "raw_path": target.encode(), "headers": headers}
            await self.inner(inner, receive, send)
            return
        await response(scope, receive, send)


def _callable(target: str) -> bool:
    """Whether a :data:`CALL` target is one of :data:`CALLABLE`, with no ``..`` or empty
    segment that could lead a path router elsewhere."""
    parts = target.split("/")[1:]
    return target.startswith(CALLABLE) and ".." not in parts and "" not in parts[:-1]


def same_origin(request: Request) -> bool:
    """Whether a state-changing request came from the daemon's own pages (a browser sends
    ``Origin`` on POSTs; a missing one is a non-browser client and passes)."""
    origin = request.headers.get("origin")
    return origin is None or urlsplit(origin).netloc == request.headers.get("host")


def _when(ts: Any) -> str:
    """A Unix time as the UTC time of day (an event's ``ts``)."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(ts)))
    except (TypeError, ValueError):
        return str(ts)


def _error_of(resp: httpx.Response) -> dict[str, Any]:
    try:
        error = resp.json().get("error")
    except ValueError:
        error = None
    if isinstance(error, dict):
        return error
    return {"message": f"HTTP {resp.status_code}: {resp.text[:200]}"}


def _error(exc: KunlunError) -> Response:
    """``exc`` answered as the API answers it (its catalog entry: status, type, code)."""
    status, body, headers = error_status_and_body(exc)
    return JSONResponse(body, status, headers)
