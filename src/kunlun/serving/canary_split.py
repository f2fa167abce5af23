"""The gateway's side of a rollout: which version of a model a request goes to.

While a rollout runs, the model's requests are split by weight between the baseline
workload and the canary workload (both serve the model's name). A request that carries
``X-Kunlun-Session`` goes to the version its session hashes to (the same one for the whole
rollout step, and across steps unless the weight change moves its bucket: a session in the
canary's share stays there as the share grows); others are drawn at random. Every answer
during a rollout carries ``X-Kunlun-Version: <role>:<workload id>`` (``canary:wl-3f2a1b``).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

from kunlun import headers as http_headers
from kunlun.serving.canary_window import BASELINE, CANARY

SESSION_HEADER = http_headers.SESSION
VERSION_HEADER = http_headers.VERSION
_BUCKETS = 10_000


@dataclass(frozen=True, slots=True)
class Split:
    """One model's split while its rollout runs (replaced whole when the step changes)."""

    rollout_id: str
    window: int
    """The rollout's gate window in force (its requests are counted under it)."""
    weight: float
    """The canary's share, in percent."""
    baseline: str
    """The baseline workload's id."""
    canary: str

    def choose(self, session: bytes | None) -> Version:
        """The version a request goes to: by its session's hash, else at random."""
        bucket = zlib.crc32(session) % _BUCKETS if session else random.randrange(_BUCKETS)
        return self.version(bucket < self.weight * (_BUCKETS / 100))

    def version(self, canary: bool) -> Version:
        role, workload = (CANARY, self.canary) if canary else (BASELINE, self.baseline)
        return Version(self.rollout_id, self.window, role, workload)


@dataclass(frozen=True, slots=True)
class Version:
    """Where one request goes during a rollout, and what its answer says."""

    rollout_id: str
    window: int
    role: str
    workload: str

    @property
    def header(self) -> bytes:
        return f"{self.role}:{self.workload}".encode()
