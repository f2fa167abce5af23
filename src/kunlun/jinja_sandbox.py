"""The sandboxed jinja2 environment every user-supplied template renders in.

Chat templates (:mod:`kunlun.engine.tokenizer`) and the prompt templates of
Request-as-a-Service endpoints (:mod:`kunlun.serving.endpoints`) come from outside the
platform: they render in jinja2's :class:`~jinja2.sandbox.ImmutableSandboxedEnvironment`
(no attribute access to internals, no mutation of the values passed in), configured like
transformers' chat templates: ``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols``
extension, ``raise_exception(message)``, ``strftime_now(fmt)`` and a ``tojson`` filter that
does not escape HTML. This module needs jinja2 alone (no tokenizer, no torch), so the daemon
can use it without the engine.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _KeysFirst(ImmutableSandboxedEnvironment):
    """``value.name`` of a mapping is its key ``name`` when it has one (jinja2 would look
    for an attribute first: ``input.items`` would be the dict method, not the field)."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        if isinstance(obj, dict) and attribute in obj:
            return obj[attribute]
        return super().getattr(obj, attribute)


def sandbox_environment(keys_first: bool = False) -> ImmutableSandboxedEnvironment:
    """A new sandboxed environment set up as the module docstring says; with
    ``keys_first``, ``value.name`` reads a mapping's key before its attributes (for
    templates over JSON data, whose fields may be called ``items``, ``keys`` or ``values``)."""
    env = (_KeysFirst if keys_first else ImmutableSandboxedEnvironment)(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)
