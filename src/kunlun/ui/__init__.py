"""The web dashboard the daemon serves at ``/ui``: login with an API key, then Devices,
Workloads, Models, Metrics, a Playground, Batches, Validation, Bench, Nodes, Rollouts and
Keys, rendered
server-side from the daemon's own API.

Everything it shows it reads through the daemon's routes, called in-process with the
logged-in key (:mod:`kunlun.ui.app`), so the API's scopes and limits hold on the page too: an
``inference`` key sees the Playground and Batches but not the admin pages. Scripts and styles ship in
``static/``; nothing is fetched from elsewhere (sites are air-gapped).
"""

from kunlun.ui.app import Dashboard
from kunlun.ui.history import MetricsHistory

__all__ = ["Dashboard", "MetricsHistory"]
