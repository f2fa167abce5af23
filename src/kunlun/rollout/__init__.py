"""Canary rollouts: a new version of a workload's model takes a growing share of its traffic
while gates compare it with the baseline over the same window, and is promoted or rolled
back on its own (``kunlun-cli rollout``, ``/api/v1/rollouts``; docs/rollouts.md).

- :mod:`~kunlun.rollout.spec`: what a rollout is asked to do, and the parsing of ``10%``,
  ``5m``, ``0.1%``;
- :mod:`~kunlun.rollout.gates`: the gate verdicts (error rate, p95 TTFT, p95 end-to-end);
- :mod:`~kunlun.rollout.controller`: the loop that starts the canary, steps, promotes and
  rolls back, and keeps the state in the store;
- :mod:`~kunlun.rollout.records`: what the controller reads off the records (states,
  refusals of a new rollout, weights, the wording of failed gates);
- :mod:`~kunlun.rollout.metrics`: the rollouts' series in ``/metrics``.

The gateway's side lives below, in :mod:`kunlun.serving`: the traffic split and sticky
sessions (:mod:`~kunlun.serving.canary_split`) and the per-version counts and latency
histograms of one step, mergeable across cluster nodes (:mod:`~kunlun.serving.canary_window`).
"""
