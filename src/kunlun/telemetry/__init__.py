"""Telemetry: device samples, the Prometheus ``/metrics`` of the daemon and its workers.

- :mod:`~kunlun.telemetry.collector`: :class:`DeviceCollector` samples every device plugin
  periodically, off the event loop (``latest()``: device id -> :class:`DeviceSample`);
- :mod:`~kunlun.telemetry.gateway_metrics`: the gateway's per-request counters (cheap, on the
  hot path);
- :mod:`~kunlun.telemetry.worker_metrics`: an engine worker's exact figures (TTFT, TPOT,
  tokens, KV cache) on the worker's own ``/metrics``;
- :mod:`~kunlun.telemetry.view`: reads an exposition back into device and replica rows
  (``kunlun-cli telemetry metrics``, ``kunlun-cli bench``);
- :mod:`~kunlun.telemetry.spec`: the ``telemetry`` section of a workload spec
  (``advanced_profiling``, ``profiling_interval_ms``).

The daemon's ``/metrics`` (:mod:`kunlun.daemon.exposition`) merges all of them, relabelling
each worker's series with its model, replica, priority and device; the gateway's queue gauge
is the gateway's own (:mod:`kunlun.serving.queue_metrics`). Every metric name is listed in ``docs/telemetry.md``.
"""
