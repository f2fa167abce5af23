"""The data of etcd's v3 JSON gateway, as :class:`~kunlun.state.etcd_client.Etcd` and its
watches (:mod:`kunlun.state.etcd_watch`) send and read it.

A key as etcd stores it (:class:`KV`); a transaction's conditions (:class:`Compare`),
operations (:class:`Op`) and result (:class:`TxnResult`); a watch event
(:class:`WatchEvent`); and the gateway's encodings: keys and values base64-encoded
(:func:`b64`), a prefix as a key range (:func:`key_span`), int64 fields as strings, fields at
their default value left out, the revision of an answer (:func:`revision_of`) and the error
inside one (:func:`error_of`). Data and functions of it only, no I/O: the client's calls and
failover, and the watch's streams, are apart from it.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

_COMPARE_RESULTS = {"==": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}
_COMPARE_FIELDS = {
    "CREATE": "create_revision",
    "MOD": "mod_revision",
    "VERSION": "version",
    "VALUE": "value",
}


@dataclass(frozen=True)
class KV:
    """One key as etcd stores it (a deleted key in a watch event: key and mod_revision)."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    def json(self) -> Any:
        """The value, decoded as JSON."""
        return json.loads(self.value)

    @classmethod
    def of(cls, data: dict[str, Any]) -> KV:
        """From the gateway's JSON form."""
        return cls(
            _unb64(data["key"]).decode(),
            _unb64(data.get("value", "")),
            int(data.get("create_revision", 0)),
            int(data.get("mod_revision", 0)),
            int(data.get("version", 0)),
            int(data.get("lease", 0)),
        )


@dataclass(frozen=True)
class Compare:
    """A transaction's condition on one key: its create or mod revision, version or value
    compared (``op``: ``==``, ``!=``, ``<``, ``>``) with an operand. A key that does not
    exist has revisions and version 0."""

    key: str
    target: str
    result: str
    operand: int | bytes

    @staticmethod
    def create_revision(key: str, op: str, rev: int) -> Compare:
        return Compare._make(key, "CREATE", op, rev)

    @staticmethod
    def mod_revision(key: str, op: str, rev: int) -> Compare:
        return Compare._make(key, "MOD", op, rev)

    @staticmethod
    def version(key: str, op: str, n: int) -> Compare:
        return Compare._make(key, "VERSION", op, n)

    @staticmethod
    def value(key: str, op: str, value: bytes | str) -> Compare:
        return Compare._make(key, "VALUE", op, _bytes(value))

    @staticmethod
    def _make(key: str, target: str, op: str, operand: int | bytes) -> Compare:
        if op not in _COMPARE_RESULTS:
            raise ValueError(f"compare operator {op!r} is not one of {list(_COMPARE_RESULTS)}")
        return Compare(key, target, _COMPARE_RESULTS[op], operand)

    def to_json(self) -> dict[str, Any]:
        operand = self.operand
        text = b64(operand) if isinstance(operand, bytes) else str(operand)
        return {
            "key": b64(self.key),
            "target": self.target,
            "result": self.result,
            _COMPARE_FIELDS[self.target]: text,
        }


@dataclass(frozen=True)
class Op:
    """One operation of a transaction: put, delete or get (one key or a whole prefix)."""

    kind: str
    key: str
    data: bytes = b""
    lease: int = 0
    prefix: bool = False

    @staticmethod
    def put(key: str, value: bytes | str, lease: int = 0) -> Op:
        return Op("put", key, _bytes(value), lease)

    @staticmethod
    def delete(key: str, prefix: bool = False) -> Op:
        return Op("delete", key, prefix=prefix)

    @staticmethod
    def get(key: str, prefix: bool = False) -> Op:
        return Op("get", key, prefix=prefix)

    def to_json(self) -> dict[str, Any]:
        if self.kind == "put":
            put = {"key": b64(self.key), "value": b64(self.data), "lease": str(self.lease)}
            return {"request_put": put}
        span = key_span(self.key, self.prefix)
        return {"request_delete_range" if self.kind == "delete" else "request_range": span}


@dataclass
class TxnResult:
    succeeded: bool
    revision: int
    responses: list[Any]
    """One per operation of the branch taken: a get's ``list[KV]``, a put's revision, a
    delete's number of deleted keys."""


@dataclass
class WatchEvent:
    type: str
    """``PUT`` or ``DELETE``."""
    kv: KV
    """For a ``DELETE``: the key and its mod_revision (the deletion's); the value is empty."""


def error_of(data: Any) -> tuple[int, str] | None:
    """(gRPC code, message) of an error answer: ``{"error": "...", "code": 14, ...}``, or
    inside a stream ``{"error": {"grpc_code": 14, "message": "...", ...}}``."""
    if not isinstance(data, dict) or not data.get("error"):
        return None
    error = data["error"]
    if isinstance(error, dict):
        return int(error.get("grpc_code", 0)), str(error.get("message", ""))
    return int(data.get("code", 0)), str(data.get("message") or error)


def op_result(response: dict[str, Any]) -> Any:
    """One response of a transaction's branch: a get's ``list[KV]``, a put's revision, a
    delete's number of deleted keys."""
    if "response_range" in response:
        return [KV.of(kv) for kv in response["response_range"].get("kvs", [])]
    if "response_put" in response:
        return revision_of(response["response_put"])
    if "response_delete_range" in response:
        return int(response["response_delete_range"].get("deleted", 0))
    return response


def event_of(data: dict[str, Any]) -> WatchEvent:
    """A watch event from its JSON form (a ``PUT`` has no ``type``)."""
    return WatchEvent(data.get("type", "PUT"), KV.of(data["kv"]))


def revision_of(data: dict[str, Any]) -> int:
    """The store's revision in an answer's header (0 when absent)."""
    return int(data.get("header", {}).get("revision", 0))


def key_span(key: str, prefix: bool) -> dict[str, str]:
    """A key, or (``prefix``) the range of every key starting with it."""
    if not prefix:
        return {"key": b64(key)}
    end = bytearray(key.encode())
    while end and end[-1] == 0xFF:
        end.pop()
    if end:
        end[-1] += 1
    else:
        end = bytearray(b"\0")  # every key
    return {"key": b64(key or "\0"), "range_end": b64(bytes(end))}


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else value


def b64(value: bytes | str) -> str:
    """A key or value as the gateway takes it: base64 of its bytes (text as UTF-8)."""
    return base64.b64encode(_bytes(value)).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)
