"""Decode steps replayed from captured device graphs: one launch per step, not one per kernel.

On an accelerator each of the model's kernel launches costs the host some microseconds, and a
small model's decode step is hundreds of launches: the device waits on Python. A captured
graph (the backend's graph class, :func:`kunlun.engine.device.graph_capture`; NVIDIA's CUDA
graphs, which a plan asks for where the plugin declares them:
:attr:`~kunlun.device.plugin.DevicePlugin.graph_capture`) records a step's launches once and
replays them with one call.
A graph replays fixed shapes at fixed addresses, so :class:`GraphedDecoder` runs every step
of sequences that all compute one token on static buffers:

- per batch size in ``sizes`` (the plan's: :func:`kunlun.planner.batching.graph_batch_sizes`), a step of that
  many rows; a step of ``n`` sequences takes the smallest size ``>= n``, and its extra rows
  are padding: token 0 at position 0, attending to one key of block 0 and writing its key and
  value into a scratch block no sequence owns (the KV cache's last block, which the runner
  allocates beyond ``num_blocks``);
- block tables padded to the width of ``max_model_len``, and a mask from the context lengths
  (computed inside the step, so it is part of the graph): the attention's shapes never
  change with the contexts' lengths.

The same static step runs uncaptured (``backend=None``) on any device: that is how the suite
checks, on a CPU, that it computes what the model's modules compute; on a device whose plugin
declares graph capture, the runner captures one graph per batch size when it loads
(``scripts/accelerator-smoke.sh`` compares the greedy tokens of both on a GPU).
"""

from __future__ import annotations

from typing import Any

import torch

from kunlun.engine.attention import AttentionContext, DecodeBatch
from kunlun.engine.device import graph_capture
from kunlun.engine.models.llama import LlamaForCausalLM
from kunlun.engine.native import NativeStatus
from kunlun.errors import ConfigError


def graphed_decoder(
    model: LlamaForCausalLM,
    sizes: tuple[int, ...],
    tp_size: int,
    max_model_len: int,
    block_size: int,
    *,
    scratch_block: int,
) -> tuple[NativeStatus, GraphedDecoder]:
    """The static decode steps of ``model`` (on one rank) for ``sizes``, captured where its
    device's backend captures graphs, and the status the runner logs."""
    if tp_size > 1:
        raise ConfigError(
            f"graph_batch_sizes: captured decode steps run on one rank, not {tp_size}"
        )
    if min(sizes) < 1:
        raise ConfigError(f"graph_batch_sizes={list(sizes)}: each size must be >= 1")
    device = model.model.embed_tokens.weight.device
    backend = graph_capture(device)
    graphed = GraphedDecoder(model, sizes, max_model_len, block_size, scratch_block,
                             backend=backend)  # fmt: skip
    how = (
        f"uncaptured ({device.type})" if backend is None else f"captured as {backend[1].__name__}s"
    )
    listed = ", ".join(map(str, graphed.sizes))
    return NativeStatus("graphs", f"static decode steps of {listed} rows, {how}"), graphed


class GraphedDecoder:
    """A model's decode steps on static buffers, captured as device graphs or run as is."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        sizes: tuple[int, ...],
        max_model_len: int,
        block_size: int,
        scratch_block: int,
        *,
        backend: tuple[Any, type] | None,
    ) -> None:
        """``backend``: the device's graph capture (:func:`kunlun.engine.device.graph_capture`),
        or None to run the static steps uncaptured."""
        if not sizes:
            raise ValueError("GraphedDecoder needs at least one batch size")
        self._model = model
        self.sizes = tuple(sorted(sizes))
        self.block_size = block_size
        self._scratch_slot = scratch_block * block_size
        weight = model.model.embed_tokens.weight
        device, largest = weight.device, self.sizes[-1]
        width = -(-max_model_len // block_size)
        self._ids = torch.zeros(largest, dtype=torch.long, device=device)
        self._positions = torch.zeros(largest, dtype=torch.long, device=device)
        self._slots = torch.full((largest,), self._scratch_slot, dtype=torch.long, device=device)
        self._tables = torch.zeros(largest, width, dtype=torch.long, device=device)
        self._lens = torch.ones(largest, dtype=torch.long, device=device)
        self._key_positions = torch.arange(width * block_size, device=device)
        self._logits: dict[int, torch.Tensor] = {}
        self._graphs: dict[int, Any] = {}
        if backend is not None:
            with torch.inference_mode():  # as the steps run (ModelRunner.run)
                self._capture_all(device, *backend)

    def _step(self, size: int) -> torch.Tensor:
        """The decode step of the first ``size`` rows of the buffers (fixed shapes only)."""
        model = self._model
        lens = self._lens[:size]
        hidden_dtype = model.model.embed_tokens.weight.dtype
        visible = self._key_positions[None, :] < lens[:, None]
        mask = torch.zeros(visible.shape, dtype=hidden_dtype, device=visible.device)
        mask = mask.masked_fill(~visible, float("-inf"))[:, None, None, :]
        batch = DecodeBatch(self._tables[:size], int(self._key_positions.numel()), mask)
        context = AttentionContext(slot_mapping=self._slots[:size], decode=batch)
        hidden = model(self._ids[:size], self._positions[:size], context)
        return model.compute_logits(hidden).float()

    def _capture_all(self, device: torch.device, backend: Any, graph_class: type) -> None:
        """One graph per batch size, largest first, sharing one memory pool (``backend``:
        the device's torch module, e.g. ``torch.<type>``, with its streams and ``graph``)."""
        pool = None
        side = backend.Stream(device)
        for size in reversed(self.sizes):
            side.wait_stream(backend.current_stream(device))
            with backend.stream(side):
                for _ in range(2):  # lazy initialisations and allocations happen outside
                    self._step(size)
            backend.current_stream(device).wait_stream(side)
            graph = graph_class()
            with backend.graph(graph, pool=pool):
                self._logits[size] = self._step(size)
            pool = graph.pool()
            self._graphs[size] = graph
        backend.synchronize(device)

    @property
    def captured(self) -> tuple[int, ...]:
        """The batch sizes replayed from graphs."""
        return tuple(sorted(self._graphs))

    def takes(self, count: int) -> bool:
        """Whether a decode step of ``count`` sequences fits a static size (more sequences
        than the largest, past the plan's 512: the model's modules run the step)."""
        return 1 <= count <= self.sizes[-1]

    def decode(
        self, tokens: list[int], positions: list[int], tables: list[list[int]], block_size: int
    ) -> torch.Tensor:
        """Float32 logits [B, vocab], as :meth:`kunlun.engine.native.decoder.CompiledDecoder.
        decode` takes and returns them."""
        count = len(tokens)
        size = next((s for s in self.sizes if s >= count), None)
        if size is None or block_size != self.block_size:
            raise ValueError(f"a decode step of {count} sequences at block size {block_size} "
                             f"is outside the captured sizes {self.sizes}")  # fmt: skip
        width = self._tables.shape[1]
        padded = [table[:width] + [0] * (width - len(table[:width])) for table in tables]
        slots = [t[p // block_size] * block_size + p % block_size
                 for t, p in zip(padded, positions, strict=True)]  # fmt: skip
        self._ids[:count].copy_(torch.tensor(tokens, dtype=torch.long))
        self._positions[:count].copy_(torch.tensor(positions, dtype=torch.long))
        self._slots[:count].copy_(torch.tensor(slots, dtype=torch.long))
        self._tables[:count].copy_(torch.tensor(padded, dtype=torch.long))
        self._lens[:count].copy_(torch.tensor([p + 1 for p in positions], dtype=torch.long))
        if count < size:  # padding rows: one key of block 0, their own KV into the scratch block
            self._ids[count:size] = 0
            self._positions[count:size] = 0
            self._slots[count:size] = self._scratch_slot
            self._tables[count:size] = 0
            self._lens[count:size] = 1
        graph = self._graphs.get(size)
        if graph is None:
            logits = self._step(size)
        else:
            graph.replay()
            logits = self._logits[size]
        return logits[:count].clone()
