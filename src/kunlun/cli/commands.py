"""The commands of ``kunlun-cli``, as data: where each lives and the line ``--help`` lists.

:mod:`kunlun.cli.main` imports only the module of the command it runs (each imports what its
commands need: the planner, the HTTP client, the state store...). ``kunlun-cli --help``, no
arguments or an unknown command import none of them: the listing is drawn from
:data:`COMMANDS` alone. A group's module builds its ``typer.Typer`` with
``help=summary(name)`` and a single command is registered with its summary as the first
paragraph of its help, so each line is written here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    module: str
    attribute: str
    group: bool
    """True: a ``typer.Typer`` of subcommands; False: one function."""
    summary: str
    """The line ``kunlun-cli --help`` lists (and the first of the command's own help)."""


COMMANDS: dict[str, Command] = {
    "plan": Command("kunlun.cli.plan", "plan", False,
                    "Plan MODEL on the devices: dtype, quantization, TP, KV blocks, operators, "
                    "options, env."),
    "bench": Command("kunlun.cli.bench", "bench", False,
                     "Benchmark an OpenAI-compatible endpoint (streaming /v1/completions, fixed "
                     "lengths)."),
    "adapt": Command("kunlun.cli.adapt", "adapt", False,
                     "Adapt a model to every pool and engine: plan, start, smoke, battery, "
                     "accuracy, bench; a pool-by-gate verdict matrix."),
    "acceptance": Command("kunlun.cli.acceptance", "app", True,
                          "Acceptance reports of the rollout layers, signed; verify one."),
    "snapshot": Command("kunlun.cli.snapshot", "app", True,
                        "Known-good snapshots: save, list, show, diff, restore."),
    "validate": Command("kunlun.cli.validate", "validate", False,
                        "Run the validation battery and print the chip-by-test matrix; exit 1 "
                        "on any FAIL."),
    "doctor": Command("kunlun.cli.main", "doctor", False,
                      "Check this machine's environment: kernel, vendor tools, drivers, "
                      "container, ports."),
    "version": Command("kunlun.cli.main", "version", False, "Print the Kunlun version."),
    "device": Command("kunlun.cli.device", "app", True,
                      "Devices: discovery, status and declarations."),
    "workload": Command("kunlun.cli.workload", "app", True,
                        "Workloads: submit, list, describe, logs, stop, scale."),
    "model": Command("kunlun.cli.model", "app", True,
                     "Models: import GGUF files, quantize, list aliases, signed packages."),
    "keys": Command("kunlun.cli.keys", "app", True,
                    "Signing keys: generate a pair, sign a file, verify it."),
    "node": Command("kunlun.cli.cluster", "nodes_app", True,
                    "Cluster nodes: list, drain, undrain."),
    "cluster": Command("kunlun.cli.cluster", "cluster_app", True,
                       "The cluster: certificates, status."),
    "apikey": Command("kunlun.cli.apikey", "app", True, "API keys: create, list, revoke."),
    "batch": Command("kunlun.cli.batch", "app", True, "Batch inference over JSON-lines files."),
    "rollout": Command("kunlun.cli.rollout", "app", True,
                       "Canary rollouts: create, status, list, promote, abort."),
    "endpoint": Command("kunlun.cli.endpoint", "app", True,
                        "Request-as-a-Service endpoints: create, list, show, delete."),
    "telemetry": Command("kunlun.cli.telemetry", "app", True,
                         "Telemetry: devices, replicas and requests."),
}  # fmt: skip
"""In the order ``--help`` lists them."""
SUBCOMMANDS: dict[str, dict[str, Command]] = {
    "workload": {
        "submit": Command("kunlun.cli.workload_submit", "submit", False,
                          "Submit a workload (options: the workload spec's fields)."),
    },
}  # fmt: skip
"""A group's commands in modules of their own, imported only when the line names them:
``workload submit``'s options are generated from the workload spec, which the group's other
commands (``workload list``) need not import."""


def summary(name: str) -> str:
    return COMMANDS[name].summary
