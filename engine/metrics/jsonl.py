"""`JsonLinesReceiver`: one JSON line per metric in a file of the server's workspace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO

from engine.metrics.receiver import Metric, MetricsReceiver
from engine.paths import no_link_out, plain_file_name

#: The file the server writes its metrics to when the config names no receiver.
DEFAULT_FILE = "metrics.jsonl"


class JsonLinesReceiver(MetricsReceiver):
    """Appends each metric as one JSON line to ``<server workspace>/<file_name>``.

    A line reads ``{"site": "site-1", "key": "local_accuracy", "value": 0.93, "round": 2,
    "step": 2, "time": 1764100000.1}`` (``round`` is 1-based, None outside a round). It is the
    server's receiver when its config names none.

    Args:
        file_name: The file's name, in the server's workspace (a plain name: no folder, no ``..``).

    Example (server config)::

        components = [ { id = metrics_log, path = engine.metrics.JsonLinesReceiver, args { } } ]
    """

    def __init__(self, file_name: str = DEFAULT_FILE) -> None:
        self.file_name = plain_file_name(file_name, "file_name", "the server's workspace")
        self.path: Path | None = None
        self._out: IO[str] | None = None

    def use_workspace(self, workspace: Path) -> None:
        self.path = Path(workspace) / self.file_name

    def receive(self, metric: Metric) -> None:
        if self._out is None:
            if self.path is None:
                raise RuntimeError("JsonLinesReceiver got a metric before use_workspace(folder)")
            self.path.parent.mkdir(parents=True, exist_ok=True)
            no_link_out(self.path, self.path.parent, "file_name", "the server's workspace")
            self._out = self.path.open("a", encoding="utf-8")
        line = {
            "site": metric.site,
            "key": metric.key,
            "value": metric.value,
            "round": metric.round,
            "step": metric.step,
            "time": round(metric.time, 3),
        }
        self._out.write(json.dumps(line) + "\n")
        self._out.flush()  # a line is whole on disk for whoever follows the file during the run

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None
