"""The compiler orchestrator: what a model needs, and how it runs on concrete devices.

- :mod:`~kunlun.planner.model_info`: a model's shape and sizes from ``config.json`` alone
  (parameters, weight and KV bytes per dtype, context, checkpoint quantization);
- :mod:`~kunlun.planner.capacity`: a device profile reduced to the numbers planning needs;
- :mod:`~kunlun.planner.estimate`: memory need and estimated tokens/s of a model on a device;
- :mod:`~kunlun.planner.operators` and :mod:`~kunlun.planner.engine_options`: the operator
  registry with its generic PyTorch fallback, and vendor attributes as engine options;
- :mod:`~kunlun.planner.plan`: the :class:`ExecutionPlan` for one replica on its devices;
- :mod:`~kunlun.planner.cache`: the plan cache under ``KUNLUN_HOME/plan-cache`` and the
  weights converted for a plan.

Choosing *which* devices is :mod:`kunlun.workload.placement`; it calls into this package.
"""
