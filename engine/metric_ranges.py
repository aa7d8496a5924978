"""The ranges metrics have by definition, when a job declares none (accuracy, AUC, F1 ... lie in [0, 1]).

One home for both the result checks (`engine.aggregators.ResultRules`: a value outside is dropped)
and ``flengine validate`` (a ``key_metric`` with neither a declared nor a default range is refused):
without a bound, a site with a valid key could report 1e9 and move the round's mean, and pick the
best model, alone.
"""

from __future__ import annotations

import re

#: Metrics bounded by their definition: a name whose last part (after ``/``, ``.`` or ``:``, less a
#: ``global_``/``local_``/``val_``/``test_``/``train_`` prefix) is one of these gets [0, 1] unless
#: the job declares its own range (e.g. ``accuracy = [0, 100]`` for percentages). Without a bound a
#: site with a valid key could report 1e9 and move the round's mean, and the best model, alone.
BOUNDED_METRICS = frozenset({"accuracy", "acc", "auc", "roc_auc", "f1", "precision", "recall", "iou", "dice"})
DEFAULT_METRIC_RANGE = (0.0, 1.0)
_PREFIX = re.compile(r"^(?:global|local|val|valid|validation|test|train|mean|avg)_")


def default_metric_range(name: str) -> tuple[float, float] | None:
    """The range a metric has when the job declares none: [0, 1] for `BOUNDED_METRICS`, else None.

    Example:
        >>> default_metric_range("global_accuracy"), default_metric_range("val/f1"), default_metric_range("loss")
        ((0.0, 1.0), (0.0, 1.0), None)
    """
    last = re.split(r"[/.:]", name)[-1].lower()
    return DEFAULT_METRIC_RANGE if _PREFIX.sub("", last) in BOUNDED_METRICS else None
