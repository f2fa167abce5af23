"""Choosing devices for a workload, with the reason for every alternative rejected.

Placement works on device *classes*: devices of one type with identical capacity (see
:attr:`DeviceCapacity.signature`). Each class is judged once per workload by filters that
return reasons (``(kept, rejected)``), in :mod:`~kunlun.workload.placement.filters`:

1. health: Unhealthy and Excluded devices are rejected with their profile's reasons;
2. explicit device: only that device's class, with only that device;
3. dtype and quantization support: the spec's dtype, or the preference order of
   :func:`kunlun.planner.plan.dtype_order`; ``w8a8`` needs ``int8`` in ``supported_dtypes``;
4. memory fit, including KV for one sequence of ``max_model_len``, at the smallest
   tensor-parallel size that fits (groups need ``p2p_enabled``; heads must divide);
5. runnable here (the torch backend imports; the embedded engine runs one unquantized
   device per replica), only when the workload is actually starting, not for a plan or dry run.

Classes that pass are ranked by ``(Degraded, preferred_device_types order, score)``: a Degraded
class only wins when nothing Ready fits, and preferred types come first, in the spec's order.
Scorers (``spec.scorer``, :mod:`~kunlun.workload.placement.scorers`): ``performance``
(default: the highest declared compute throughput for the compute dtype, then the decode
estimate; :mod:`kunlun.planner.estimate`), ``roofline`` (the highest decode estimate),
``binpack`` (the device left with the least free memory) and ``spread`` (the device with the
most free memory). Within a class the device (or the group of nearest devices by topology
distance) with the most free memory is taken, except under ``binpack``. Why the winner won and
each other class lost is worded in :mod:`~kunlun.workload.placement.reasons`.

Memory is tracked in a :class:`Ledger`: weights are reserved whole, while the workloads that
share a device split the memory left after all their weights by priority, 3:2:1 for
high:normal:low; a workload fits only when every sharer's split still holds one full-length
sequence of KV. :mod:`~kunlun.workload.placement.placer` has :class:`Placer`, which does all
of this for one workload after another, and the entry points :func:`place` and
:func:`demand_of`.
"""

from kunlun.workload.ledger import Ledger
from kunlun.workload.placement.filters import runnable
from kunlun.workload.placement.placer import Placement, Placer, demand_of, place
from kunlun.workload.placement.scorers import SCORERS

__all__ = ["SCORERS", "Ledger", "Placement", "Placer", "demand_of", "place", "runnable"]
