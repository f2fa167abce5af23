"""``kunlun-cli workload submit`` and ``kunlun-cli plan`` take the workload spec's fields as
options generated from :class:`~kunlun.workload.spec.WorkloadSpec`
(:mod:`kunlun.cli.spec_flags`): every field a flag can hold is one, its help is the field's
description and its choices the field's values; what is given reaches the daemon as the
spec's value. ``workload list`` does not import the spec to build them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import typer
from tests.daemons import Daemon
from tests.test_light_imports import run_cli

from kunlun.cli.plan import PLANNED, plan
from kunlun.cli.spec_flags import FILE_ONLY, SPELLINGS, flaggable, spec_data
from kunlun.cli.workload_submit import submit
from kunlun.workload.spec import WorkloadSpec


def options_of(command: Any) -> dict[str, Any]:
    """The options typer makes of ``command`` (its click parameters), by name."""
    app = typer.Typer()
    app.command()(command)
    app.command("other")(lambda: None)  # two commands: the app stays a group
    group: Any = typer.main.get_command(app)
    (made,) = [c for name, c in group.commands.items() if name != "other"]
    return {p.name: p for p in made.params if p.param_type_name == "option"}


def test_every_spec_field_but_the_nested_ones_is_a_submit_option_saying_what_the_spec_says() -> (
    None
):
    options = options_of(submit)
    fields = WorkloadSpec.model_fields
    assert set(flaggable()) == fields.keys() - FILE_ONLY and FILE_ONLY == {"telemetry", "faults"}
    for name in flaggable():
        option = options[name]
        assert (fields[name].description or "") in (option.help or ""), name
        assert option.opts[0] == SPELLINGS.get(name, ("--" + name.replace("_", "-"),))[0]
        assert option.default is None, name  # absent: the spec's own default applies
    assert not FILE_ONLY & options.keys()
    choices = {name: [m.value for m in options[name].type_descriptor.annotation]
               for name in ("dtype", "scorer")}  # fmt: skip
    assert choices == {"dtype": ["fp32", "bf16", "fp16"],
                       "scorer": ["performance", "roofline", "binpack", "spread"]}  # fmt: skip
    assert {"--batch-size", "--max-num-seqs"} == set(options["max_num_seqs"].opts)
    assert {"file", "dry_run", "json"} <= options.keys()


def test_plan_takes_the_fields_planning_reads() -> None:
    options = options_of(plan)
    assert options["model"].required and set(PLANNED) <= options.keys()
    for name in PLANNED:
        assert (WorkloadSpec.model_fields[name].description or "") in (options[name].help or "")


def test_given_values_become_spec_values(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    given = {"preferred_device_types": "nvidia, cpu,", "chat_template": str(template),
             "max_num_seqs": 3, "device": None}  # fmt: skip
    assert spec_data(given) == {"preferred_device_types": ["nvidia", "cpu"], "max_num_seqs": 3,
                                "chat_template": template.read_text()}  # fmt: skip


def test_a_value_outside_a_fields_choices_is_refused_naming_the_flag() -> None:
    env = dict(os.environ, KUNLUN_ENDPOINT="http://127.0.0.1:9")
    out, _ = run_cli("workload", "submit", "--model", "m", "--priority", "urgent", env=env)
    assert "--priority" in out and "urgent" in out and "high" in out, out


def test_workload_list_builds_no_spec_options() -> None:
    env = dict(os.environ, KUNLUN_ENDPOINT="http://127.0.0.1:9")
    out, modules = run_cli("workload", "list", env=env)
    assert "cli.daemon_unreachable" in out, out
    assert not {"kunlun.cli.workload_submit", "kunlun.workload.spec"} & set(modules)
    listing, modules = run_cli("workload", "--help", env=env)
    assert "submit" in listing and "kunlun.cli.workload_submit" not in modules


@pytest.mark.usefixtures("bare_daemon")
def test_submitted_options_reach_the_plan(bare_daemon: Daemon, tiny_model: Path) -> None:
    made = bare_daemon.cli("workload", "submit", "--model", str(tiny_model), "--dtype", "fp32",
                           "--batch-size", "3", "--max-model-len", "256", "--scorer", "spread",
                           "--preferred-device-types", "cpu", "--dry-run", "--json")  # fmt: skip
    assert made.returncode == 0, made.stderr
    plan = json.loads(made.stdout)["placement"]["plan"]
    assert (plan["dtype"], plan["max_num_seqs"], plan["max_model_len"]) == ("fp32", 3, 256)
