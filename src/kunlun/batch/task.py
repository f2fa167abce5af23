"""The batch task: what ``kunlun-cli batch run`` reads from ``task.yaml`` and its flags.

The fields are the seed's (``task_name``, ``model_alias``, ``input_file``, ``output_dir``,
``batch_size``, ``max_retries``, ``timeout_seconds``). A flag overrides the file. Relative
paths in the file are relative to the file's folder (so a task runs the same from any
directory); relative paths given as flags are relative to the current directory. Errors
name ``file:line`` and the field for a value from the file, the flag for a value from the
command line.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kunlun.errors import ConfigError, Location

TASK_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
"""No ``:``, so ``X-Request-Id: <task_name>:<id>:<attempt>`` splits unambiguously."""


class BatchTask(BaseModel):
    """One batch job: which model, which input lines, where results go, how hard to try."""

    model_config = ConfigDict(extra="forbid")

    task_name: str = Field(
        pattern=TASK_NAME_PATTERN,
        description="Names the job in request ids; default: the input file's name without suffix.",
    )
    model_alias: str = Field(min_length=1, description="The served model name to send to.")
    input_file: Path = Field(
        description="JSON lines: {id, prompt} or {id, messages}, plus parameters."
    )
    output_dir: Path = Field(description="Where results.jsonl, failures.jsonl and summary.json go.")
    batch_size: int = Field(8, ge=1, le=1024, description="Requests in flight at once.")
    max_retries: int = Field(
        3, ge=0, le=100, description="Retries per request after the first try."
    )
    timeout_seconds: float = Field(
        120.0, gt=0, le=86400, description="Limit for one attempt of one request."
    )


FLAGS = {name: "--" + name.replace("_", "-") for name in BatchTask.model_fields}
"""The command-line flag of each field."""


@dataclass
class _Source:
    """Where each given value came from: a line of the task file, or a flag."""

    path: str | None
    lines: dict[str, int]
    flags: set[str]

    def where(self, name: str) -> Location:
        if name in self.flags:
            return Location(FLAGS[name])
        if self.path is None:
            return Location("command line", field=name)
        return Location(self.path, self.lines.get(name), name)


def load_task(config: Path | None, flags: dict[str, Any]) -> BatchTask:
    """The task from ``config`` (optional) with ``flags`` (None = not given) on top."""
    data: dict[str, Any] = {}
    lines: dict[str, int] = {}
    if config is not None:
        data, lines = _read_yaml(config)
        for name in ("input_file", "output_dir"):
            if isinstance(data.get(name), str):
                data[name] = str(config.parent / data[name])
    given = {name: value for name, value in flags.items() if value is not None}
    data.update(given)
    source = _Source(str(config) if config else None, lines, set(given))
    if "task_name" not in data and isinstance(data.get("input_file"), str | Path):
        data["task_name"] = _default_name(Path(data["input_file"]))
    try:
        return BatchTask.model_validate(data)
    except ValidationError as exc:
        raise _config_error(exc, source) from None


def _default_name(input_file: Path) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]", "-", input_file.stem).lstrip("._-")
    return name[:128] or "batch"


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """The file's top-level mapping and the line of each key."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"cannot read the task file: {exc.strerror}", location=Location(str(path))
        ) from None
    try:
        root = yaml.compose(text)
        values = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise ConfigError(
            f"not valid YAML: {getattr(exc, 'problem', None) or exc}",
            location=Location(str(path), mark.line + 1 if mark else None),
        ) from None
    if root is None:
        return {}, {}
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError(
            "a task file must be a mapping of field: value",
            location=Location(str(path), root.start_mark.line + 1),
        )
    lines: dict[str, int] = {}
    for key, _ in root.value:
        name = str(key.value)
        if name in lines:
            raise ConfigError(
                f"field {name!r} is given twice (first at line {lines[name]})",
                location=Location(str(path), key.start_mark.line + 1, name),
            )
        lines[name] = key.start_mark.line + 1
    return {str(k): v for k, v in values.items()}, lines


def _config_error(exc: ValidationError, source: _Source) -> ConfigError:
    """One error listing every problem, each with its place."""
    problems = []
    for err in exc.errors(include_url=False):
        name = str(err["loc"][0]) if err["loc"] else "(task)"
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(name, list(BatchTask.model_fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"{source.where(name)}: unknown field{hint}")
        elif err["type"] == "missing":
            where = f"{source.path}: " if source.path else ""
            problems.append(
                f"{where}missing {name!r}: give it in the task file or as {FLAGS[name]}"
            )
        else:
            problems.append(f"{source.where(name)}: {err['msg']} (got {err.get('input')!r})")
    if len(problems) == 1:
        return ConfigError(f"invalid batch task: {problems[0]}")
    return ConfigError(f"{len(problems)} problems in the batch task:\n  " + "\n  ".join(problems))
