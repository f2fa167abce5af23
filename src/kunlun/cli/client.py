"""Talking to the daemon from the CLI: endpoint discovery, API key, clear failures.

The endpoint is ``$KUNLUN_ENDPOINT``, else the address in the running daemon's pid file
under ``KUNLUN_HOME``, else ``http://127.0.0.1:8470``. ``$KUNLUN_API_KEY`` is sent as a bearer
token when set.

The transport is the standard library's (``urllib``): a command's whole run is one or two
small JSON requests, and an HTTP client library's import would cost more CPU than the
command itself (``docs/benchmarks.md``, the CLI's start-up).
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from kunlun.address import DEFAULT_ENDPOINT
from kunlun.daemon.pidfile import pid_info
from kunlun.errors import KunlunError, error_class
from kunlun.paths import kunlun_home


class DaemonUnreachable(KunlunError):
    code = "cli.daemon_unreachable"
    exit_code = 3


class DaemonRequestFailed(KunlunError):
    code = "cli.request_failed"
    remote_code: str | None = None


def running_endpoint() -> str | None:
    """The endpoint of a daemon we know runs: ``$KUNLUN_ENDPOINT`` or a live pid file."""
    if os.environ.get("KUNLUN_ENDPOINT"):
        return os.environ["KUNLUN_ENDPOINT"].rstrip("/")
    info = pid_info(kunlun_home())
    if info is None:
        return None
    host = "127.0.0.1" if info["host"] in ("0.0.0.0", "::") else info["host"]
    return f"http://{host}:{info['port']}"


def state_client() -> DaemonClient | None:
    """For commands that change state either way: the daemon when ``KUNLUN_ENDPOINT`` is set
    or when this home's daemon is a cluster node (its state is in etcd, not ``state.db``);
    None: work on ``KUNLUN_HOME`` directly."""
    if os.environ.get("KUNLUN_ENDPOINT"):
        return DaemonClient()
    info = pid_info(kunlun_home())
    return DaemonClient() if info is not None and info.get("cluster") else None


class DaemonClient:
    def __init__(
        self, endpoint: str | None = None, timeout: float = 60.0, api_key: str | None = None
    ) -> None:
        self.endpoint = (endpoint or running_endpoint() or DEFAULT_ENDPOINT).rstrip("/")
        headers = {}
        self.api_key = api_key or os.environ.get("KUNLUN_API_KEY") or None
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        self._headers = headers
        self._timeout = timeout

    def request(self, method: str, path: str, *, shown: str | None = None, **kwargs: Any) -> Any:
        """The JSON answer of ``method path``; clear errors for failures, which name the
        path as ``shown`` when given (a path that holds a secret)."""
        return self._send(method, path, shown=shown, **kwargs).json()

    def get_text(self, path: str) -> str:
        """The text answer of ``GET path`` (e.g. the Prometheus exposition of ``/metrics``)."""
        return self._send("GET", path).text

    def _send(
        self,
        method: str,
        path: str,
        *,
        shown: str | None = None,
        json: Any = None,
        params: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Reply:
        # (``json``, ``params`` and ``timeout`` as the callers of an HTTP client library write them)
        resp = self._exchange(method, path, json, params, timeout or self._timeout)
        if resp.status_code >= 400:
            try:
                err = resp.json()["error"]
                message, code = err["message"], err.get("code") or err.get("type")
            except (ValueError, KeyError, TypeError):
                message, code = resp.text[:500], None
            failure = DaemonRequestFailed(
                f"{method} {shown or path} -> {resp.status_code}: {message}",
                hint="set KUNLUN_API_KEY to a valid key" if resp.status_code == 401 else None,
            )
            known = error_class(code) if isinstance(code, str) else None
            if known is not None:  # the exit status the same error has when the CLI raises it
                failure.exit_code = known.exit_code
            else:
                failure.exit_code = 2 if resp.status_code in (400, 404, 422) else 1
            failure.remote_code = code
            raise failure
        return resp

    def _exchange(
        self, method: str, path: str, body: Any, params: dict[str, Any] | None, timeout: float
    ) -> Reply:
        url = self.endpoint + path
        if params:
            query = {k: _query_value(v) for k, v in params.items() if v is not None}
            url += ("&" if "?" in path else "?") + urllib.parse.urlencode(query)
        headers = dict(self._headers)
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as answer:  # noqa: S310
                return Reply(answer.status, answer.read())
        except urllib.error.HTTPError as exc:  # a status >= 400: the caller reads its body
            try:
                return Reply(exc.code, exc.read())
            finally:
                exc.close()
        except (OSError, urllib.error.URLError) as exc:  # refused, reset, timed out, DNS
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise DaemonUnreachable(
                f"cannot reach the Kunlun daemon at {self.endpoint}: {reason}",
                hint="start it with `kunlun-platform`, or set KUNLUN_ENDPOINT to where it runs",
            ) from None

    def get(self, path: str, **kwargs: Any) -> Any:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> Any:
        return self.request("POST", path, **kwargs)

    def delete(self, path: str, **kwargs: Any) -> Any:
        return self.request("DELETE", path, **kwargs)

    def run_workload(
        self, spec: dict[str, Any], timeout_s: float
    ) -> tuple[str, dict[str, Any], str | None]:
        """Submit the workload ``spec`` and wait until it is RUNNING with a ready replica:
        its id, its last row, and why it did not come up (None: it did). A refused spec
        raises, as any failed request does."""
        job = self.post("/api/v1/workloads", json=spec)["workload_id"]
        deadline = time.monotonic() + timeout_s
        while True:
            row = self.get(f"/api/v1/workloads/{job}")
            if row["state"] in ("FAILED", "STOPPED"):
                return job, row, f"{row['state']}: {row.get('reason')}"
            if row["state"] == "RUNNING" and any(r["ready"] for r in row["replicas"]):
                return job, row, None
            if time.monotonic() > deadline:
                return job, row, f"not RUNNING within {timeout_s:g} s (state {row['state']})"
            time.sleep(0.5)


@dataclass(frozen=True)
class Reply:
    """An HTTP answer of the daemon: status and body."""

    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


def _query_value(value: Any) -> str:
    """A query parameter as the daemon reads it (``true``/``false`` for booleans)."""
    return str(value).lower() if isinstance(value, bool) else str(value)
