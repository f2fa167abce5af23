"""Kunlun Platform: a chip-agnostic LLM inference platform.

Packages (one line each; see docs/architecture.md):
- ``kunlun.device``: device plugins, declarations, device profiles and the inventory.
- ``kunlun.engine``: the portable PyTorch inference engine (no HTTP, no pydantic).
- ``kunlun.cli``: ``kunlun-cli`` and ``kunlun-device-probe``.
- ``kunlun.errors``: the one error hierarchy, with stable codes.
"""

__version__ = "0.1.0"
