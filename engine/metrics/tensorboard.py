"""`TensorBoardReceiver`: the job's metrics as TensorBoard event files, one run per site.

Needs the ``tensorboard`` package (``pip install flengine[tensorboard]``); it is imported only
when a metric is written, and `flengine validate` (and the job's start) report it missing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, ClassVar

from engine.metrics.receiver import Metric, MetricsReceiver
from engine.metrics.rules import check_site_name, is_metric_value
from engine.paths import path_inside, plain_file_name

#: The package the writer needs, and the extra of flengine that installs it.
EXTRA = "tensorboard"
INSTALL_HINT = f"pip install flengine[{EXTRA}]"


class TensorBoardReceiver(MetricsReceiver):
    """Writes every metric as a TensorBoard scalar under ``<server workspace>/<folder_name>/<site>``.

    Each client is a run named after it (``tb/site-1``), and the server's round metrics of the
    global model are the run ``tb/server``. A metric's tag is its key; its step is
    `Metric.step`: the 1-based round when the key is logged once a round, counting on when it is
    logged several times a round. Watch a running job with
    ``tensorboard --logdir <workspace>/server/tb``.

    Args:
        folder_name: The folder in the server's workspace that holds the runs (a plain name).
        flush_interval_s: Longest time, in seconds, a metric waits in memory before it is on disk.

    Example (server config)::

        components = [ { id = tb, path = engine.metrics.TensorBoardReceiver, args { } } ]
    """

    #: What `flengine validate` checks is installed: import name -> flengine extra.
    REQUIRED_EXTRAS: ClassVar[dict[str, str]] = {"tensorboard": EXTRA}

    def __init__(self, folder_name: str = "tb", flush_interval_s: float = 10.0) -> None:
        self.folder_name = plain_file_name(folder_name, "folder_name", "the server's workspace")
        if not (is_metric_value(flush_interval_s) and flush_interval_s > 0):
            raise ValueError(f"flush_interval_s: expected seconds > 0, got {flush_interval_s!r}")
        if importlib.util.find_spec("tensorboard") is None:
            raise ImportError(f"TensorBoardReceiver needs the 'tensorboard' package: {INSTALL_HINT}")
        self.flush_interval_s = float(flush_interval_s)
        self.folder: Path | None = None
        self._writers: dict[str, Any] = {}

    def use_workspace(self, workspace: Path) -> None:
        self.folder = Path(workspace) / self.folder_name

    def receive(self, metric: Metric) -> None:
        writer = self._writers.get(metric.site) or self._open(metric.site)
        writer.add_scalar(metric.key, metric.value, global_step=metric.step, walltime=metric.time)

    def close(self) -> None:
        writers, self._writers = self._writers, {}
        for writer in writers.values():
            writer.close()

    def _open(self, site: str) -> Any:
        """The writer of ``site``'s run, made on its first metric."""
        if self.folder is None:
            raise RuntimeError("TensorBoardReceiver got a metric before use_workspace(folder)")
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(f"TensorBoardReceiver needs the 'tensorboard' package: {INSTALL_HINT}") from e
        self.folder.mkdir(parents=True, exist_ok=True)
        run = path_inside(self.folder, check_site_name(site), "site", f"the {self.folder_name}/ folder")
        writer = SummaryWriter(log_dir=str(run), flush_secs=self.flush_interval_s)
        self._writers[site] = writer
        return writer
