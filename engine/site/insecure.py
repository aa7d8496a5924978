"""Whether a site turns CURVE off (``cell { insecure = true }``), and the warning every such start prints.

Kept apart from `engine.site.endpoint` (which imports torch through the codec) so that the
simulator can check a job and warn without importing torch itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: The warning every start of an insecure site prints (and logs).
INSECURE_WARNING = (
    "WARNING: insecure = true: connections are neither encrypted nor authenticated; anyone who "
    "reaches the port can join as any site, read every model and change the result"
)
#: The key of a config's ``cell`` object that turns CURVE off; the rest are `CellSettings`.
INSECURE_KEY = "insecure"


def insecure_requested(config: Mapping[str, Any]) -> bool:
    """Whether a validated config says ``cell { insecure = true }``."""
    return config.get("cell", {}).get(INSECURE_KEY) is True
