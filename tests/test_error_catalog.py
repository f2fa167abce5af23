"""The error catalog: every error class of ``src/kunlun`` declares where it answers (its stable
code, exit status, HTTP status and the OpenAI type and code of its body) beside it, and each
entry is one a client can act on."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import kunlun
from kunlun.errors import KunlunError
from kunlun.protocol.openai_errors import error_status_and_body

OPENAI_TYPES = {
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "rate_limit_error",
    "service_unavailable_error",
    "timeout_error",
    "server_error",
}
"""The ``error.type`` values OpenAI's API and SDKs use."""


def every_error_class() -> list[type[KunlunError]]:
    for info in pkgutil.walk_packages(kunlun.__path__, "kunlun."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    found: list[type[KunlunError]] = []
    todo: list[type[KunlunError]] = [KunlunError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(set(found), key=lambda c: f"{c.__module__}.{c.__qualname__}")


CLASSES = every_error_class()


def test_the_catalog_holds_every_error_class_of_the_platform() -> None:
    names = {c.__name__ for c in CLASSES}
    assert len(CLASSES) > 40
    assert {"PromptTooLong", "QueueFull", "ModelNotFound", "InjectedFault", "OverBudget"} <= names


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_each_error_class_declares_a_whole_entry(cls: type[KunlunError]) -> None:
    assert cls.code and cls.code == cls.code.strip() and " " not in cls.code
    assert isinstance(cls.exit_code, int) and 1 <= cls.exit_code <= 125
    assert 400 <= cls.http_status <= 599
    assert cls.openai_type in OPENAI_TYPES
    if cls.http_status >= 500:  # the server's fault: no client error type
        assert cls.openai_type in {"server_error", "service_unavailable_error", "timeout_error"}
    else:
        assert cls.openai_type not in {"server_error", "timeout_error"}
    assert cls.openai_code is None or (cls.openai_code and " " not in cls.openai_code)


def test_codes_name_one_class_each() -> None:
    """A code is where a log line, a CLI message or an admin API answer points: one class.
    Classes that only add a parent's code to a module of their own (none today) would share."""
    owners: dict[str, list[str]] = {}
    for cls in CLASSES:
        if "code" in vars(cls):
            owners.setdefault(cls.code, []).append(cls.__qualname__)
    assert {code: names for code, names in owners.items() if len(names) > 1} == {}


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_the_inference_api_answers_each_class_with_its_entry(cls: type[KunlunError]) -> None:
    exc = cls.__new__(cls)
    KunlunError.__init__(exc, "what went wrong")
    status, body, _ = error_status_and_body(exc)
    assert status == cls.http_status
    assert body["error"]["type"] == cls.openai_type
    assert body["error"]["code"] == (cls.openai_code or cls.code)
    assert body["error"]["message"].startswith("what went wrong")
