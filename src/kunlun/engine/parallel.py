"""This process's place in a tensor-parallel group, and the collectives the model needs.

:class:`TPGroup` is what model code sees: ``rank``, ``size`` and two collectives over the
default ``torch.distributed`` process group (one group per process). With ``size == 1``
(:data:`SINGLE`) the collectives are identities, so a single-device model runs exactly the
arithmetic it always did. Starting the ranks is :mod:`kunlun.engine.tp_group`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """Rank ``rank`` of ``size`` ranks; ``size > 1`` needs an initialized process group."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of ``x`` over the ranks (in place; ``x`` itself when alone)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` [..., n] concatenated on the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup()
"""The group of one: no communication."""
