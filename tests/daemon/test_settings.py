"""``kunlun-platform``'s options are the fields of :class:`DaemonSettings`
(:mod:`kunlun.daemon.settings`): ``--help`` lists every one with its environment variable
and without loading the app, the ``--model`` options say what their workload spec fields
say, and a settings model becomes a typer command whose values arrive whole, checked by
typer first (bounds, environment variables)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Annotated

import typer
from pydantic import BaseModel, Field
from typer.testing import CliRunner

from kunlun.daemon.settings import DaemonSettings, Flag, flag_names, flag_of, settings_command
from kunlun.workload.spec import WorkloadSpec


def test_help_lists_every_option_and_loads_neither_the_app_nor_uvicorn() -> None:
    code = (
        "import sys\n"
        "sys.argv = ['kunlun-platform', '--help']\n"
        "from kunlun.daemon.main import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('LOADED', sorted(m for m in ('torch', 'uvicorn', 'fastapi', 'kunlun.daemon.app')"
        " if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "250"}, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "LOADED []" in done.stdout, done.stdout
    for name, field in DaemonSettings.model_fields.items():
        flag = flag_of(field)
        for spelling in flag_names(name, field):
            assert (spelling.split("/")[0] in done.stdout) != flag.hidden, spelling
        if flag.envvar is not None and not flag.hidden:
            assert flag.envvar in done.stdout, flag.envvar


def test_a_model_option_says_what_its_spec_field_says() -> None:
    fields = DaemonSettings.spec_fields()
    assert fields["max_num_seqs"] == "max_num_seqs" and fields["served_model_name"] == "name"
    for name, spec_field in fields.items():
        described = WorkloadSpec.model_fields[spec_field].description
        assert described and described in str(DaemonSettings.model_fields[name].description)
    given = DaemonSettings(model="m", max_num_seqs=3, gpu_memory_utilization=0.5)
    assert given.served_fields() == {"max_num_seqs": 3, "memory_utilization": 0.5}
    alone = DaemonSettings(max_num_seqs=3, quantization="w8a8")
    assert alone.served_flags() == ["--max-num-seqs", "--quantization"]


class Small(BaseModel):
    """Two options, one with its own spelling, bounds and an environment variable."""

    size: Annotated[int, Flag(("--size", "-s"), envvar="SMALL_SIZE")] = Field(
        3, ge=1, le=9, description="How big."
    )
    loud: bool = Field(False, description="Say it.")


def small_app(seen: list[Small]) -> typer.Typer:
    app = typer.Typer()

    @app.command()
    @settings_command(Small)
    def run(ctx: typer.Context, settings: Small) -> None:
        """Run small."""
        seen.append(settings)

    return app


def test_a_settings_model_becomes_the_command_s_options() -> None:
    seen: list[Small] = []
    runner = CliRunner()
    assert runner.invoke(small_app(seen), ["-s", "5", "--loud"]).exit_code == 0
    assert runner.invoke(small_app(seen), [], env={"SMALL_SIZE": "7"}).exit_code == 0
    assert seen == [Small(size=5, loud=True), Small(size=7)]
    refused = runner.invoke(small_app(seen), ["--size", "10"])
    assert refused.exit_code == 2 and "--size" in refused.output and len(seen) == 2
    shown = runner.invoke(small_app(seen), ["--help"], env={"COLUMNS": "200"}).output
    assert "How big." in shown and "SMALL_SIZE" in shown and "--loud" in shown
