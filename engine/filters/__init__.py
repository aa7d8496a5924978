"""Task data and result filters (`Filter`, `ExcludeVars`)."""

from engine.filters.exclude_vars import ExcludeVars
from engine.filters.filter import Filter

__all__ = ["ExcludeVars", "Filter"]
