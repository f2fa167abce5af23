"""Resolve device strings to torch devices; the one module that knows vendor backends.

Every other module of :mod:`kunlun.engine` takes a :class:`torch.device` (or a string it
passes through :func:`resolve_device`) and never names a vendor. A vendor's PyTorch backend
is an out-of-tree extension (``torch_npu``, ``torch_mlu``, ``torch_musa``) that registers its
device type when imported, so resolving ``"npu:0"`` imports ``torch_npu`` first.
"""

from __future__ import annotations

import importlib

import torch

from kunlun.errors import EngineError

#: Device types whose backend lives in a separate extension module, and that module's name.
VENDOR_EXTENSIONS: dict[str, str] = {
    "npu": "torch_npu",
    "mlu": "torch_mlu",
    "musa": "torch_musa",
}


def resolve_device(device: str | torch.device) -> torch.device:
    """Turn ``"cpu"``, ``"cuda:0"``, ``"npu:1"``... into a :class:`torch.device`.

    Imports the vendor extension named in :data:`VENDOR_EXTENSIONS` when the type needs one.
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
    module = VENDOR_EXTENSIONS.get(device_type)
    if module is None:
        return
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise EngineError(
            f"device {text!r} needs the PyTorch extension {module!r}, which is not installed",
            hint=f"install the vendor's build of {module} (see README, per-vendor installs)",
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
