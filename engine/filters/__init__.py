"""Task data and result filters (`Filter`, `ExcludeVars`, `PercentilePrivacy`, `GaussianPrivacy`)."""

from engine.filters.exclude_vars import ExcludeVars
from engine.filters.filter import Filter
from engine.filters.gaussian_privacy import GaussianPrivacy
from engine.filters.percentile_privacy import PercentilePrivacy

__all__ = ["ExcludeVars", "Filter", "GaussianPrivacy", "PercentilePrivacy"]
