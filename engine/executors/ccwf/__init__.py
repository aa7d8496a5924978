"""Client-controlled workflows, client side: executors for the ``swarm_*`` and ``cse_*`` tasks.

The server side is `engine.workflows.ccwf`.
"""

from engine.executors.ccwf.client_side import ClientSideController
from engine.executors.ccwf.cross_site_eval import CrossSiteEvalClientController
from engine.executors.ccwf.swarm import SwarmClientController

__all__ = ["ClientSideController", "CrossSiteEvalClientController", "SwarmClientController"]
