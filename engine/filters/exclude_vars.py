"""`ExcludeVars`: drop named parameters from the model a shareable carries."""

from __future__ import annotations

import logging
import re
from typing import Any

from engine.filters.filter import Filter
from engine.model import DXO, FLMODEL_KEY, FLModel, Shareable

logger = logging.getLogger(__name__)


class ExcludeVars(Filter):
    """Remove matching entries from the params of the carried `FLModel`, or the data of the carried DXO.

    The FLModel or DXO is changed in place: its params (data) dict is replaced by a filtered
    copy, so the dict it held before (a training script's ``state_dict()``, say) is not touched.
    A shareable that carries neither passes through unchanged.

    Args:
        exclude_vars: Exact names to remove (a list), or a regular expression (a string) matched
            with ``re.search`` against each name.

    Raises:
        ValueError: ``exclude_vars`` is not a valid regular expression.
        TypeError: ``exclude_vars`` is neither a string nor a list of strings.

    Example:
        In ``config_fed_client.conf``, keep BatchNorm statistics local::

            task_result_filters = [
              { tasks = [train], filters = [
                { path = engine.filters.ExcludeVars, args { exclude_vars = "running_(mean|var)$" } } ] }
            ]
    """

    same_for_every_site = True

    def __init__(self, exclude_vars: list[str] | str) -> None:
        if isinstance(exclude_vars, str):
            try:
                self._pattern: re.Pattern[str] | None = re.compile(exclude_vars)
            except re.error as e:
                raise ValueError(f"exclude_vars: {exclude_vars!r} is not a valid regular expression: {e}") from e
            self._names: frozenset[str] = frozenset()
        elif isinstance(exclude_vars, (list, tuple)) and all(isinstance(n, str) for n in exclude_vars):
            self._pattern = None
            self._names = frozenset(exclude_vars)
        else:
            raise TypeError(
                f"exclude_vars: expected a list of names or a regular expression string, got {exclude_vars!r}"
            )

    def _excluded(self, name: str) -> bool:
        if self._pattern is not None:
            return self._pattern.search(name) is not None
        return name in self._names

    def _filtered(self, values: dict[str, Any], site: str) -> dict[str, Any]:
        kept = {name: value for name, value in values.items() if not self._excluded(name)}
        logger.debug("vars excluded: site=%s excluded=%d kept=%d", site, len(values) - len(kept), len(kept))
        return kept

    def process(self, shareable: Shareable, site: str) -> Shareable:
        """Return ``shareable`` with the matching params (DXO data) removed."""
        model = shareable.get(FLMODEL_KEY)
        if isinstance(model, FLModel):
            if model.params is not None:
                model.params = self._filtered(model.params, site)
            return shareable
        try:
            dxo = DXO.from_shareable(shareable)
        except ValueError:
            return shareable  # carries no model: nothing to filter
        dxo.data = self._filtered(dxo.data, site)
        return shareable
