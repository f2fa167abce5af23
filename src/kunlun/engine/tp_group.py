"""A tensor-parallel group seen from rank 0: start the other ranks, feed them, watch them.

Design: rank 0 is the engine's own process. It runs the scheduler, the sampler and the
detokenizer as with one device, and its :class:`~kunlun.engine.model_runner.ModelRunner`
holds rank 0's slices of the model. Ranks 1..N-1 are *follower* processes
(``python -m kunlun.engine.tp_worker``, this interpreter) that rank 0 starts with
``PR_SET_PDEATHSIG`` set, so they die with it. Each follower loads its own slices, then loops:
receive a step (:class:`~kunlun.engine.model_runner.StepBatch`, broadcast by rank 0 before
its own forward), run the same forward, take part in its all-reduces and all-gathers; ``None``
ends the loop. The group is ready when every rank has loaded (a barrier).

Rank death: a watcher thread waits on every follower. A follower that exits while the group
is open is a fatal group failure: rank 0's collectives with it fail on their closed
connections, and the watcher calls :attr:`RankGroup.on_lost` with the reason; the worker fails its streams and exits, and the node agent restarts the replica
as a group. When rank 0 dies, the followers die with it (the death signal).

On CPU all ranks share the machine's cores: each rank gets ``num_threads // tp`` threads
(at least one).
"""

from __future__ import annotations

import ctypes
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import fields
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kunlun.engine.device import resolve_device
from kunlun.engine.engine_config import EngineConfig
from kunlun.engine.parallel import TPGroup
from kunlun.engine.step_batch import StepBatch
from kunlun.errors import EngineError

logger = logging.getLogger(__name__)

#: How long ranks wait for each other to join the group and in any one collective.
GROUP_TIMEOUT = timedelta(minutes=10)
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent exits (Linux; no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def rank_threads(config: EngineConfig) -> int | None:
    """Torch threads of each rank: on CPU the ranks split ``num_threads`` (or all cores)."""
    if config.tensor_parallel_size == 1 or not str(config.device).startswith("cpu"):
        return config.num_threads
    total = config.num_threads or torch.get_num_threads()
    return max(1, total // config.tensor_parallel_size)


def rank_device(device: str, rank: int) -> str:
    """The device of ``rank``: ``cuda:2`` -> ``cuda:2+rank``; cpu stays cpu (ranks share it)."""
    kind, _, index = str(device).partition(":")
    if kind == "cpu" or rank == 0:
        return str(device)
    return f"{kind}:{int(index or 0) + rank}"


def config_to_json(config: EngineConfig) -> str:
    """Every engine setting, as JSON for the followers (each field travels, so a setting
    added to :class:`EngineConfig` reaches every rank); ``num_threads`` is per rank."""
    raw: dict[str, Any] = {item.name: getattr(config, item.name) for item in fields(config)}
    raw["model_dir"] = str(config.model_dir)
    raw["dtype"] = str(config.dtype).removeprefix("torch.")
    raw["num_threads"] = rank_threads(config)
    return json.dumps(raw)


def config_from_json(text: str) -> EngineConfig:
    """Inverse of :func:`config_to_json`."""
    raw: dict[str, Any] = json.loads(text)
    raw["dtype"] = getattr(torch, raw["dtype"])
    return EngineConfig(**raw)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RankGroup:
    """Rank 0's handle on its followers. Build it before the model, then :meth:`attach`
    the runner, :meth:`wait_ready`, and :meth:`close` when done."""

    def __init__(self, size: int, backend: str, device: str = "cpu") -> None:
        """Start ranks 1..N-1 and join the ``backend`` process group as rank 0 on ``device``.

        The followers wait for their settings (:meth:`load`), so the group can be formed
        before the model is chosen: the worker forms it before its sandbox forbids new
        processes.
        """
        self.size = size
        self.backend = backend
        self.device = resolve_device(device)  # imports the vendor's torch extension
        self.on_lost: Callable[[str], None] = self._log_lost
        """Called once, from the watcher thread, when a rank dies while the group is open."""
        self._closing = False
        self._ready = False
        self._lost: str | None = None
        address = f"tcp://127.0.0.1:{_free_port()}"
        self.followers = [self._start(rank, address) for rank in range(1, size)]
        self._watcher = threading.Thread(target=self._watch, name="kunlun-tp-watch", daemon=True)
        self._watcher.start()
        try:
            use_device(self.device)
            dist.init_process_group(
                self.backend, init_method=address, rank=0, world_size=self.size,
                timeout=GROUP_TIMEOUT,
            )  # fmt: skip
        except Exception as exc:
            self.close()
            raise EngineError(
                f"tensor_parallel_size={self.size}: the {self.backend} process group did not "
                f"form: {type(exc).__name__}: {exc}"
            ) from exc
        self.group = TPGroup(rank=0, size=self.size)

    def _start(self, rank: int, address: str) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "kunlun.engine.tp_worker", "--rank", str(rank),
                   "--world-size", str(self.size), "--backend", self.backend,
                   "--init-method", address, "--device", rank_device(str(self.device), rank)]  # fmt: skip
        return subprocess.Popen(command, preexec_fn=die_with_parent)

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return [proc.pid for proc in self.followers]

    def load(self, config: EngineConfig) -> None:
        """Send the followers the engine settings; each then loads its slices."""
        if config.tensor_parallel_size != self.size:
            raise EngineError(
                f"tensor_parallel_size={config.tensor_parallel_size} but the group has "
                f"{self.size} ranks"
            )
        self._broadcast(config_to_json(config))

    def attach(self, runner: Any) -> None:
        """Send every step ``runner`` executes to the followers before it runs."""
        runner.step_hook = self.send

    def send(self, batch: StepBatch | None) -> None:
        """Broadcast one step (``None``: stop) to the followers."""
        if self._lost is not None:
            raise EngineError(self._lost)
        self._broadcast(batch)

    def _broadcast(self, message: object) -> None:
        device = None if self.device.type == "cpu" else self.device
        dist.broadcast_object_list([message], src=0, device=device)

    def wait_ready(self) -> None:
        """Return once every rank has loaded its slices (raises if a rank failed)."""
        try:
            dist.barrier()
            self._ready = True
        except Exception as exc:
            self.close()
            raise EngineError(
                self._lost or f"a tensor-parallel rank failed to load: {type(exc).__name__}: {exc}"
            ) from exc

    def close(self) -> None:
        """Stop the followers of a ready group (asking first, killing what does not stop
        within 30 s) and leave the group. Followers of a group that never became ready or
        lost a rank are not waited for: they die with this process (their death signal)."""
        if self._closing:
            return
        self._closing = True
        if self._ready and self._lost is None:
            try:
                self.send(None)
            except Exception as exc:
                logger.warning("could not tell the tensor-parallel ranks to stop: %s", exc)
            else:
                for proc in self.followers:
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _watch(self) -> None:
        """Wait for any follower to exit; outside :meth:`close`, that ends the group."""
        done = threading.Event()
        exited: list[tuple[int, int]] = []

        def wait(rank: int, proc: subprocess.Popen[bytes]) -> None:
            code = proc.wait()
            exited.append((rank, code))
            done.set()

        for rank, proc in enumerate(self.followers, start=1):
            threading.Thread(target=wait, args=(rank, proc), daemon=True).start()
        done.wait()
        if self._closing:
            return
        rank, code = exited[0]
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        self._lost = (
            f"tensor-parallel rank {rank} of {self.size} (pid {self.followers[rank - 1].pid}) "
            f"died ({how}); the replica's group must restart"
        )
        # the other ranks die with rank 0 (the worker exits on this); rank 0's collectives
        # with the dead rank fail on their closed connections
        self.on_lost(self._lost)

    @staticmethod
    def _log_lost(reason: str) -> None:
        logger.error("%s", reason)


def use_device(device: torch.device) -> None:
    """Make ``device`` this process's current accelerator (collectives run there)."""
    if device.type != "cpu" and device.index is not None:
        torch.accelerator.set_device_index(device.index)


def follower_main(rank: int, world_size: int, backend: str, init_method: str, device: str) -> int:
    """Rank ``rank``'s life on ``device``: join, receive the settings, load its slices, run
    the steps rank 0 sends."""
    from kunlun.engine.model_runner import ModelRunner

    die_with_parent()
    here = resolve_device(device)  # imports the vendor's torch extension
    use_device(here)
    target = None if here.type == "cpu" else here
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size,
        timeout=GROUP_TIMEOUT,
    )  # fmt: skip
    settings: list[Any] = [None]
    dist.broadcast_object_list(settings, src=0, device=target)
    config = config_from_json(settings[0]).validate()
    runner = ModelRunner(
        Path(config.model_dir), device=here, dtype=config.dtype,
        block_size=config.block_size, num_blocks=config.num_blocks,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes, max_model_len=config.max_model_len,
        num_threads=config.num_threads,
        group=TPGroup(rank=rank, size=config.tensor_parallel_size),
    )  # fmt: skip
    dist.barrier()
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0, device=target)
        batch = message[0]
        if batch is None:
            break
        runner.run(batch)
    dist.destroy_process_group()
    return 0
