"""A site's network side: its settings (name, keys, cell limits) and the `SiteEndpoint` built from them.

Sits above cells, security and streaming and below executors, the Client API and the runtime,
which all take an endpoint instead of assembling cells themselves. Public API::

    from engine.site import SiteEndpoint, SiteSettings
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.site.insecure import INSECURE_WARNING, insecure_requested

if TYPE_CHECKING:
    from engine.site.endpoint import ScriptCredentials, SiteEndpoint, SiteSettings, cell_settings_of

#: Imported when first used: the endpoint imports torch, which a caller that only checks a
#: config for ``insecure`` (the simulator's own process) does not need.
_FROM_ENDPOINT = frozenset({"ScriptCredentials", "SiteEndpoint", "SiteSettings", "cell_settings_of"})


def __getattr__(name: str) -> Any:
    if name in _FROM_ENDPOINT:
        from engine.site import endpoint

        return getattr(endpoint, name)
    raise AttributeError(f"module 'engine.site' has no attribute {name!r}")


__all__ = [
    "INSECURE_WARNING",
    "ScriptCredentials",
    "SiteEndpoint",
    "SiteSettings",
    "cell_settings_of",
    "insecure_requested",
]
