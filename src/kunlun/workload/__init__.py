"""Workloads: what to serve (the spec), their lifecycle, and where they run."""
