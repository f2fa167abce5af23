"""How a request's JSON schema is read before it constrains an answer: objects closed, and
with ``strict`` every property required.

A schema as written lets a lot through that no client wants: an object that does not say
``additionalProperties`` accepts any extra key, so a small model that pastes a tool's schema
into the arguments writes on until ``max_tokens``; an unbounded integer accepts digits for
ever. The rules, for every schema that constrains an answer (``response_format``'s
``json_schema``, ``guided_json``, a tool's ``parameters`` under ``tool_choice`` required or a
named function, SGLang's ``json_schema``), as vLLM's default backend (xgrammar) reads them:

- **Closed objects.** An object schema that lists ``properties`` and says nothing of
  ``additionalProperties``, ``patternProperties`` or ``unevaluatedProperties`` gets
  ``"additionalProperties": false``. To let extra keys through, say so:
  ``"additionalProperties": true`` (or a schema for them). An object that lists no
  properties (``{"type": "object"}``, what ``json_object`` mode asks for) stays open: it means
  any object. The branches of an ``allOf`` are left as written (each would close the others'
  keys out); their properties' own schemas are still read.
- **Bounded integers.** An integer with no ``minimum``/``maximum`` (or exclusive ones) is held
  to ±(2**53 - 1), the integers every JSON parser reads exactly (RFC 8259, section 6).
- **strict.** With ``strict: true`` (``response_format.json_schema.strict``,
  ``tools[].function.strict``), every listed property is also required, as OpenAI's strict
  mode requires of the schemas it accepts.

The request's own schema object is never changed: :func:`closed` returns a copy.
"""

from __future__ import annotations

import copy
from typing import Any

SAFE_INTEGER = 2**53 - 1
"""The largest integer every JSON parser reads exactly (RFC 8259, section 6)."""

_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
"""Keywords whose value maps names to schemas."""
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
"""Keywords whose value is a list of schemas."""
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
                  "propertyNames", "unevaluatedProperties", "additionalItems")  # fmt: skip
"""Keywords whose value is one schema (``items`` may also be a list: older drafts)."""
_OPENING = ("additionalProperties", "patternProperties", "unevaluatedProperties")
"""Keywords with which a schema says which keys beyond its ``properties`` it accepts."""


def closed(schema: Any, *, strict: bool = False) -> Any:
    """A copy of ``schema`` read by the module's rules: objects that list properties
    closed, integers bounded, and with ``strict`` every property required."""
    result = copy.deepcopy(schema)
    pending: list[tuple[Any, bool]] = [(result, True)]
    while pending:  # (iterative: the request's nesting is bounded, the stack need not be)
        node, may_close = pending.pop()
        if isinstance(node, list):  # ``items`` as a list (older drafts)
            pending.extend((entry, True) for entry in node)
            continue
        if not isinstance(node, dict):
            continue
        _read(node, may_close, strict)
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                pending.extend((entry, True) for entry in node[key].values())
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                pending.extend((entry, True) for entry in node[key])
        for key in _SUBSCHEMA_ONE:
            pending.append((node.get(key), True))
        if isinstance(node.get("allOf"), list):
            pending.extend((entry, False) for entry in node["allOf"])
    return result


def _read(node: dict[str, Any], may_close: bool, strict: bool) -> None:
    """Apply the rules to one schema object, in place (a copy's)."""
    properties = node.get("properties")
    if isinstance(properties, dict) and properties:
        if may_close and not any(key in node for key in _OPENING):
            node["additionalProperties"] = False
        if strict:
            required = node.get("required")
            listed = list(required) if isinstance(required, list) else []
            node["required"] = listed + [name for name in properties if name not in listed]
    if _types(node) == {"integer"}:
        if "minimum" not in node and "exclusiveMinimum" not in node:
            node["minimum"] = -SAFE_INTEGER
        if "maximum" not in node and "exclusiveMaximum" not in node:
            node["maximum"] = SAFE_INTEGER


def _types(node: dict[str, Any]) -> set[str]:
    kind = node.get("type")
    if isinstance(kind, str):
        return {kind}
    return {k for k in kind if isinstance(k, str)} if isinstance(kind, list) else set()
