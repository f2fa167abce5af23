"""Figures and names the gateway's edge is defined by, kept free of imports so that the daemon's
command line and request log can read them without loading the web stack."""

from __future__ import annotations

DEFAULT_MAX_SEQUENCES = 256
"""Most sequences (prompts x ``n``) one inference request may ask for, by default
(``kunlun-platform --max-sequences-per-request``, ``KUNLUN_MAX_SEQUENCES_PER_REQUEST``)."""
CLIENT_GONE = 499
"""Status counted and logged when the client disconnects before its answer is complete
(while it waits in the gateway's queue, or mid-stream)."""
PRIORITIES = ("high", "normal", "low")
"""The priority classes of requests, API keys and workloads, most urgent first (ties in the
gateway's fair queuing go to the earlier one)."""
