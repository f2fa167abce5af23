"""Resolve device strings to torch devices; the one module of the engine that imports
vendor backends.

Every other module of :mod:`kunlun.engine` takes a :class:`torch.device` (or a string it
passes through :func:`resolve_device`) and never names a vendor. A vendor's PyTorch backend
is an out-of-tree extension (``torch_npu``, ``torch_mlu``, ``torch_gcu``...) that registers
its device type when imported, so resolving ``"npu:0"`` imports ``torch_npu`` first. Which
module registers which device type is the device plugins' fact (``torch_device_type`` and
``torch_module``); this module asks them through :func:`kunlun.device.registry.torch_extension`
and keeps no table of its own.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Any

import torch

from kunlun.errors import EngineError


@lru_cache(maxsize=32)
def extension_module(device_type: str) -> str | None:
    """The extension module that registers torch device type ``device_type`` (None: built
    into torch), as the device plugins say; asked once per type and process."""
    from kunlun.device.registry import torch_extension

    return torch_extension(device_type)


def resolve_device(device: str | torch.device) -> torch.device:
    """Turn ``"cpu"``, ``"cuda:0"``, ``"npu:1"``... into a :class:`torch.device`.

    Imports the vendor extension that the type's device plugin names, when it needs one.
    Raises :class:`EngineError` naming the device when the string is malformed or the
    extension is not installed.
    """
    if isinstance(device, torch.device):
        _import_extension(device.type, str(device))
        return device
    text = device.strip()
    device_type = text.split(":", 1)[0]
    _import_extension(device_type, text)
    try:
        return torch.device(text)
    except RuntimeError as exc:
        raise EngineError(f"invalid device {device!r}: {exc}") from exc


def _import_extension(device_type: str, text: str) -> None:
    """Import the vendor extension that registers ``device_type``, when there is one."""
    import_extension(extension_module(device_type), text)


def import_extension(module: str | None, device: str) -> None:
    """Import ``module``, the extension that ``device`` needs (nothing when None).

    Raises :class:`EngineError` naming the module and the device when it is not installed."""
    if module is None:
        return
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise EngineError(
            f"device {device!r} needs the PyTorch extension {module!r}, which is not installed",
            hint=f"install the vendor's build of {module} (see docs/devices.md, per-vendor installs)",
        ) from exc


def synchronize(device: torch.device) -> None:
    """Wait until all work queued on ``device`` has finished (no-op on cpu)."""
    if device.type == "cpu":
        return
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        accelerator.synchronize(device)
        return
    backend = getattr(torch, device.type, None)
    if backend is not None and hasattr(backend, "synchronize"):
        backend.synchronize(device)


def graph_capture(device: torch.device) -> tuple[Any, type] | None:
    """The torch backend module and graph class that capture ``device``'s kernel launches as
    one replayable graph (:mod:`kunlun.engine.graphs`), or None where the engine captures
    none: CUDA devices (NVIDIA, and AMD through ROCm's build of torch.cuda) have
    ``torch.cuda.CUDAGraph``; other backends' graph APIs are not wired in yet."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda, torch.cuda.CUDAGraph
