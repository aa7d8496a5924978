"""Client-controlled workflows, server side: Swarm learning and cross-site evaluation.

The clients' side is `engine.executors.ccwf` (executors routed ``swarm_*`` and ``cse_*``).
"""

from engine.workflows.ccwf.cross_site_eval import CrossSiteEvalServerController
from engine.workflows.ccwf.server_side import ServerSideController
from engine.workflows.ccwf.swarm import SwarmServerController

__all__ = ["CrossSiteEvalServerController", "ServerSideController", "SwarmServerController"]
