"""Task data and result filters (`Filter`, `ExcludeVars`, `PercentilePrivacy`, `GaussianPrivacy`, `Quantize`)."""

from engine.filters.exclude_vars import ExcludeVars
from engine.filters.filter import Filter
from engine.filters.gaussian_privacy import GaussianPrivacy
from engine.filters.percentile_privacy import PercentilePrivacy
from engine.filters.quantize import Quantize

__all__ = ["ExcludeVars", "Filter", "GaussianPrivacy", "PercentilePrivacy", "Quantize"]
