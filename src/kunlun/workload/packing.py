"""What ``kunlun-cli model pack`` packs: the model planned for its target device the way a
workload would be placed there, with the device at rest so that packing is reproducible
(:func:`plan_package`); :func:`kunlun.offline.package.pack` then writes and signs it."""

from __future__ import annotations

import math
from pathlib import Path

from kunlun.errors import Location, ModelFileMissing
from kunlun.offline.package import MODEL_DIR, PackInput

MIB = 1 << 20


def plan_package(
    model: str,
    *,
    target_device: str | None = None,
    quantize: str | None = None,
    dtype: str | None = None,
    replay: Path | None = None,
    config: Path | None = None,
) -> PackInput:
    """Plan ``model`` (an alias or a path) for ``target_device`` (``--replay``/``--config``:
    for a recorded node) as the package will run it."""
    from kunlun.device.inventory import build_inventory
    from kunlun.device.registry import load_plugins
    from kunlun.paths import kunlun_home
    from kunlun.planner.cache import device_snapshot
    from kunlun.planner.launch import engine_launch
    from kunlun.planner.model_info import inspect_model, locate_model
    from kunlun.state.sqlite import SQLiteStore
    from kunlun.workload.placement import place
    from kunlun.workload.spec import parse_spec

    home = kunlun_home()
    state = home / "state.db"
    name, path = locate_model(SQLiteStore(state) if state.exists() else None, model)
    if not any(path.glob("*.safetensors")):
        raise ModelFileMissing(
            f"model {model!r} has no weights (*.safetensors) to pack", location=Location(str(path))
        )
    fields = {"model": model, "device": target_device, "quantization": quantize, "dtype": dtype}
    spec = parse_spec({k: v for k, v in fields.items() if v is not None}, "command line")
    inventory = build_inventory(config=config, replay=replay)
    # the plan is for the device, not for this moment of it: idle, so packing is reproducible
    inventory.profiles = [p.at_rest() for p in inventory.profiles]
    info = inspect_model(path, name)
    placement = place(spec, inventory, info)
    plan, group = placement.plans[0], placement.groups[0]
    plan.model_path = None  # where the packer kept it means nothing to an installer
    profiles = {f"{p.device_type}:{p.index}": p for p in inventory.profiles}
    plugin = load_plugins().plugins.get(plan.device_type)
    kv_mb = math.ceil(info.kv_bytes_per_token(plan.dtype) * plan.max_model_len / MIB)
    default_declaration = home / "device-plugin-config.yaml"  # the daemon's, when none given
    if config is None and replay is None and default_declaration.is_file():
        config = default_declaration
    return PackInput(
        name=name,
        path=path,
        plan=plan,
        launch=engine_launch(plan, plugin, MODEL_DIR, name, None, None),
        snapshot=[device_snapshot(c) for c in group],
        profiles=[profiles[c.device_id].to_dict() for c in group if c.device_id in profiles],
        device_types=sorted({c.device_type for c in group}),
        min_memory_mb=plan.weight_memory_mb + kv_mb,
        declaration=config,
    )
