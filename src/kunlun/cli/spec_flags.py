"""The workload spec's fields as command-line options, written once: in the spec.

``kunlun-cli workload submit`` takes one option per field of
:class:`~kunlun.workload.spec.WorkloadSpec` that a flag can hold, and ``kunlun-cli plan`` the
ones planning reads. Each option's type, choices (a ``Literal`` field's values), help (the
field's description) and default (the spec's, applied when the flag is absent) come from the
field; what is written here is only how a field is spelled where that is more than
``--field-name`` (:data:`SPELLINGS`), and which fields only a spec file sets
(:data:`FILE_ONLY`). The daemon's ``--model`` options read the same descriptions
(:func:`kunlun.daemon.settings.spec_option`).

A command declares its own options as usual and a keyword ``spec`` parameter;
:func:`spec_command` adds the spec's options to its signature (typer reads the signature)
and hands the command the fields given, as spec data (:func:`spec_data`).
"""

from __future__ import annotations

import enum
import functools
import inspect
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, Literal

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from kunlun.workload.chat_template import read_chat_template
from kunlun.workload.spec import WorkloadSpec

SPELLINGS: dict[str, tuple[str, ...]] = {
    "tensor_parallel_size": ("--tp-size", "--tensor-parallel-size"),
    "quantization": ("--quantization", "--quantize"),
    "max_num_seqs": ("--max-num-seqs", "--batch-size"),
    "memory_utilization": ("--gpu-memory-utilization", "--memory-utilization"),
}
"""Spellings besides ``--field-name``, the first shown in messages: vLLM's (``--tp-size``,
``--gpu-memory-utilization``), the seed's ``--quantize``, and ``--batch-size``, the old name
of ``max_num_seqs``."""


def _nested(annotation: Any) -> bool:
    """Whether a field's type is an object of its own (a pydantic model, optional or not)."""
    kinds = typing.get_args(annotation) or (annotation,)
    return any(isinstance(k, type) and issubclass(k, BaseModel) for k in kinds)


FILE_ONLY = frozenset(n for n, f in WorkloadSpec.model_fields.items() if _nested(f.annotation))
"""The fields that are objects of their own (telemetry, faults): set in a ``--file`` spec."""
LISTS_SEPARATOR = ","
"""A list field's flag takes its items comma-separated (``--preferred-device-types a,b``)."""
MORE_HELP = {
    "chat_template": " The flag takes a template file, or the template text.",
    "preferred_device_types": " Comma-separated.",
}
"""What a flag takes beyond the field (its help ends with it)."""


def flag_names(name: str) -> tuple[str, ...]:
    return SPELLINGS.get(name, ("--" + name.replace("_", "-"),))


def _flag_type(name: str, field: FieldInfo) -> Any:
    """The option's type: a ``Literal`` field's values as an enumeration (typer offers
    them as choices), a number as itself, anything else as text (a list's items
    comma-separated)."""
    annotation = field.annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = args[0] if len(args) == 1 else str
    if typing.get_origin(annotation) is Literal:
        values = [str(v) for v in typing.get_args(annotation)]
        return enum.Enum(name, [(v, v) for v in values], type=str)
    if annotation in (int, float):
        return annotation
    return str


def flaggable() -> list[str]:
    """The spec's fields a flag can hold, in the spec's order."""
    return [n for n in WorkloadSpec.model_fields if n not in FILE_ONLY]


def spec_parameters(fields: Iterable[str]) -> list[inspect.Parameter]:
    """One keyword parameter per spec field of ``fields``, as typer reads a command's
    options: None unless the flag is given (then the spec's default applies)."""
    parameters = []
    for name in fields:
        field = WorkloadSpec.model_fields[name]
        kind = _flag_type(name, field)
        help_text = (field.description or "") + MORE_HELP.get(name, "")
        option = typer.Option(None, *flag_names(name), help=help_text)
        parameters.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                            default=option, annotation=kind | None))  # fmt: skip
    return parameters


def spec_data(values: dict[str, Any]) -> dict[str, Any]:
    """The spec fields given on the command line (absent ones left out), as the spec takes
    them: a list field's items split, a chat template read from its file."""
    data: dict[str, Any] = {}
    for name, value in values.items():
        if value is None:
            continue
        if isinstance(value, enum.Enum):
            value = value.value
        elif typing.get_origin(WorkloadSpec.model_fields[name].annotation) is list:
            value = [item.strip() for item in value.split(LISTS_SEPARATOR) if item.strip()]
        elif name == "chat_template":
            value = read_chat_template(value)
        data[name] = value
    return data


def spec_command(
    fields: Iterable[str] | None = None,
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Make ``run(..., spec=...)`` a typer command with its own options and one per spec
    field of ``fields`` (default: every one a flag holds); ``run`` gets its own options by
    name and ``spec``, the fields given (:func:`spec_data`)."""
    names = list(fields) if fields is not None else flaggable()

    def decorate(run: Callable[..., None]) -> Callable[..., None]:
        hints = typing.get_type_hints(run, include_extras=True)
        own = [p.replace(annotation=hints[p.name], kind=inspect.Parameter.KEYWORD_ONLY)
               for p in inspect.signature(run).parameters.values() if p.name != "spec"]  # fmt: skip

        @functools.wraps(run)
        def command(**values: Any) -> None:
            given = {name: values.pop(name) for name in names}
            run(**values, spec=spec_data(given))

        required = [p for p in own if p.default is p.empty]
        rest = [p for p in own if p.default is not p.empty]
        parameters = [*required, *spec_parameters(names), *rest]  # as --help lists them
        command.__signature__ = inspect.Signature(parameters, return_annotation=None)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in parameters}
        return command

    return decorate
