"""``device-plugin-config.yaml``: the operator's declaration of each device.

The file has one top-level key, ``devices:``, a list of declarations::

    devices:
      - device_type: ascend
        device_id: 0
        hbm_memory_mb: 32768        # the per-vendor memory split
        sys_memory_mb: 1024
        p2p_enabled: true
        p2p_bandwidth_gbps: 32
        topology_distance: [0, 16, 32, 32]   # this device's row of the N x N matrix
        fp16_compute_power_tflops: 256
        int8_compute_power_tflops: 512
        supported_dtypes: [fp16, bf16, int8]
        custom_attributes: {aclnn_fusion_enabled: true}

:func:`load_declarations` returns each declaration with the line of every field, so later
checks (a declared figure the hardware contradicts) can name ``file:line``. Every problem in
the file itself is a :class:`~kunlun.errors.ConfigError` naming file, line, field and value.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kunlun.device.dtypes import DTYPES
from kunlun.errors import ConfigError, Location

#: Memory split fields of all vendors; which ones a device type uses is the plugin's business.
MEMORY_SPLIT_FIELDS = (
    "hbm_memory_mb",
    "sys_memory_mb",
    "mlu_memory_mb",
    "ddr_memory_mb",
    "vram_memory_mb",
    "gddr6_memory_mb",
)


class Declaration(BaseModel):
    """One device as the operator declares it. Every field but the first two is optional."""

    model_config = ConfigDict(extra="forbid", strict=False)

    device_type: str = Field(description="Plugin family, e.g. ascend, cambricon, nvidia, cpu.")
    device_id: int = Field(ge=0, description="Index of the device within its type.")
    name: str | None = Field(None, description="Display name override.")
    total_memory_mb: int | None = Field(None, gt=0, description="Device memory usable, MiB.")
    hbm_memory_mb: int | None = Field(None, gt=0, description="Ascend: high-bandwidth memory.")
    sys_memory_mb: int | None = Field(None, ge=0, description="Ascend: host-mapped memory.")
    mlu_memory_mb: int | None = Field(None, gt=0, description="Cambricon: on-card memory.")
    ddr_memory_mb: int | None = Field(None, ge=0, description="Cambricon: DDR memory.")
    vram_memory_mb: int | None = Field(None, gt=0, description="Hygon: VRAM.")
    gddr6_memory_mb: int | None = Field(None, ge=0, description="Hygon: GDDR6 memory.")
    memory_bandwidth_gbps: float | None = Field(None, gt=0, description="Memory GB/s.")
    p2p_enabled: bool | None = Field(None, description="Peer-to-peer copies to other devices.")
    p2p_bandwidth_gbps: float | None = Field(None, gt=0, description="P2P GB/s.")
    topology_distance: list[int] | None = Field(
        None, description="This device's row of the distance matrix (0 self)."
    )
    fp32_compute_power_tflops: float | None = Field(None, gt=0)
    fp16_compute_power_tflops: float | None = Field(None, gt=0)
    bf16_compute_power_tflops: float | None = Field(None, gt=0)
    fp8_compute_power_tflops: float | None = Field(None, gt=0)
    int8_compute_power_tflops: float | None = Field(None, gt=0, description="TOPS.")
    int4_compute_power_tflops: float | None = Field(None, gt=0, description="TOPS.")
    supported_dtypes: list[str] | None = Field(None, description=f"Subset of {list(DTYPES)}.")
    custom_attributes: dict[str, str | int | float | bool] = Field(default_factory=dict)

    @field_validator("supported_dtypes")
    @classmethod
    def _dtypes_known(cls, value: list[str] | None) -> list[str] | None:
        for dtype in value or []:
            if dtype not in DTYPES:
                raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        return value

    @field_validator("topology_distance")
    @classmethod
    def _distances_non_negative(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(d < 0 for d in value):
            raise ValueError(f"distances must be >= 0, got {value}")
        return value


FIELDS: tuple[str, ...] = tuple(Declaration.model_fields)


@dataclass
class DeclaredDevice:
    """A validated declaration and where each of its fields sits in the file."""

    decl: Declaration
    path: str
    line: int
    field_lines: dict[str, int] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.decl.device_type}:{self.decl.device_id}"

    def where(self, field_name: str | None = None) -> Location:
        line = self.field_lines.get(field_name or "", self.line)
        return Location(self.path, line, field_name)

    def declared_fields(self) -> set[str]:
        return set(self.decl.model_fields_set)


def load_declarations(
    path: str | Path, known_types: Iterable[str], memory_fields: dict[str, tuple[str, str]]
) -> list[DeclaredDevice]:
    """Parse and validate ``path``. ``known_types`` are the registered plugins' device types;
    ``memory_fields`` maps a device type to its (device, host) memory split field names.

    Raises :class:`ConfigError` listing every problem, each with file:line and field.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"cannot read config: {exc.strerror}", location=Location(str(path))
        ) from exc
    return parse_declarations(text, str(path), sorted(known_types), memory_fields)


def parse_declarations(
    text: str, path: str, known_types: list[str], memory_fields: dict[str, tuple[str, str]]
) -> list[DeclaredDevice]:
    """Like :func:`load_declarations`, from the file's text."""
    root = _compose(text, path)
    items = _device_nodes(root, path)
    problems: list[tuple[Location, str]] = []
    devices: list[DeclaredDevice] = []
    seen: dict[tuple[str, int], int] = {}
    for node in items:
        dev = _one_declaration(node, path, known_types, memory_fields, problems)
        if dev is None:
            continue
        key = (dev.decl.device_type, dev.decl.device_id)
        if key in seen:
            problems.append(
                (dev.where("device_id"), f"{dev.id} is declared twice (first at line {seen[key]})")
            )
            continue
        seen[key] = dev.line
        devices.append(dev)
    if problems:
        lines = [f"{loc}: {msg}" for loc, msg in problems]
        raise ConfigError(
            f"{len(problems)} problem(s) in {path}:\n  " + "\n  ".join(lines),
            hint="fix the fields named above; `kunlun-device-probe --config FILE` re-checks",
        )
    return devices


def _compose(text: str, path: str) -> yaml.Node | None:
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"not valid YAML: {problem}", location=Location(path, line)) from None


def _device_nodes(root: yaml.Node | None, path: str) -> list[yaml.Node]:
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError(
            "the file must be a mapping with a top-level 'devices:' list",
            location=Location(path, _line(root)),
        )
    devices = None
    for key, value in root.value:
        if key.value != "devices":
            hint = _did_you_mean(str(key.value), ["devices"])
            raise ConfigError(
                f"unknown top-level key {key.value!r}{hint}",
                location=Location(path, _line(key), str(key.value)),
            )
        devices = value
    if not isinstance(devices, yaml.SequenceNode):
        raise ConfigError(
            "'devices' must be a list of device declarations",
            location=Location(path, _line(devices) or _line(root), "devices"),
        )
    return list(devices.value)


def _one_declaration(
    node: yaml.Node,
    path: str,
    known_types: list[str],
    memory_fields: dict[str, tuple[str, str]],
    problems: list[tuple[Location, str]],
) -> DeclaredDevice | None:
    line = _line(node) or 0
    if not isinstance(node, yaml.MappingNode):
        problems.append((Location(path, line), "each entry of 'devices' must be a mapping"))
        return None
    field_lines = {str(k.value): _line(k) or line for k, _ in node.value}
    before = len(problems)
    for key in field_lines:
        if key not in FIELDS:
            problems.append(
                (
                    Location(path, field_lines[key], key),
                    f"unknown field {key!r}{_did_you_mean(key, FIELDS)}",
                )
            )
    keys = [str(k.value) for k, _ in node.value]
    for key in {k for k in keys if keys.count(k) > 1}:
        problems.append((Location(path, field_lines[key], key), f"field {key!r} is given twice"))
    try:
        data = _construct(node)
    except yaml.YAMLError as exc:
        problems.append((Location(path, line), f"cannot read this entry: {exc}"))
        return None
    dtype = data.get("device_type")
    if "device_type" not in data:
        problems.append(
            (Location(path, line, "device_type"), "missing required field 'device_type'")
        )
    elif dtype not in known_types:
        problems.append(
            (
                Location(path, field_lines["device_type"], "device_type"),
                f"unknown device_type {dtype!r}{_did_you_mean(str(dtype), known_types)}; "
                f"known: {', '.join(known_types)}",
            )
        )
    elif memory_fields is not None:
        _check_memory_split(str(dtype), data, field_lines, path, memory_fields, problems)
    if len(problems) > before:
        return None
    try:
        decl = Declaration.model_validate(data)
    except ValidationError as exc:
        for err in exc.errors():
            name = str(err["loc"][0]) if err["loc"] else None
            value = data.get(name) if name else None
            msg = err["msg"].removeprefix("Value error, ")
            problems.append(
                (Location(path, field_lines.get(name or "", line), name), f"{msg} (got {value!r})")
            )
        return None
    return DeclaredDevice(decl, path, line, field_lines)


def _construct(node: yaml.Node) -> dict[str, Any]:
    """Plain Python data of one mapping node (safe constructors only)."""
    loader = yaml.SafeLoader("")
    try:
        value = loader.construct_mapping(node, deep=True)  # type: ignore[arg-type]
    finally:
        loader.dispose()
    return {str(k): v for k, v in value.items()}


def _check_memory_split(
    device_type: str,
    data: dict[str, Any],
    field_lines: dict[str, int],
    path: str,
    memory_fields: dict[str, tuple[str, str]],
    problems: list[tuple[Location, str]],
) -> None:
    own = memory_fields.get(device_type)
    for name in MEMORY_SPLIT_FIELDS:
        if name in data and (own is None or name not in own):
            uses = (
                f"{device_type} uses {own[0]} / {own[1]}"
                if own
                else f"{device_type} has no memory split; use total_memory_mb"
            )
            problems.append(
                (
                    Location(path, field_lines[name], name),
                    f"{name} is not a {device_type} field: {uses}",
                )
            )


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _line(node: yaml.Node | None) -> int | None:
    return node.start_mark.line + 1 if node is not None else None
