"""A site's network side: its settings (name, keys, cell limits) and the `SiteEndpoint` built from them.

Sits above cells, security and streaming and below executors, the Client API and the runtime,
which all take an endpoint instead of assembling cells themselves. Public API::

    from engine.site import SiteEndpoint, SiteSettings
"""

from __future__ import annotations

from engine.site.endpoint import (
    INSECURE_WARNING,
    ScriptCredentials,
    SiteEndpoint,
    SiteSettings,
    cell_settings_of,
    insecure_requested,
)

__all__ = [
    "INSECURE_WARNING",
    "ScriptCredentials",
    "SiteEndpoint",
    "SiteSettings",
    "cell_settings_of",
    "insecure_requested",
]
