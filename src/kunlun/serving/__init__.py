"""Serving: engine worker processes, the replica set, and the OpenAI-compatible gateway."""
