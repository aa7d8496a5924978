"""The ``download_to_disk`` switch of the server workflows (FedAvg, ScatterAndGather)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.aggregators.weighted import resolve_value
from engine.controller.context import DiskDownloadArea, JobContext
from engine.model import FLModel, shown_round
from engine.paths import JobPaths

log = logging.getLogger(__name__)


@contextlib.contextmanager
def receiving_to_disk(context: JobContext, enabled: bool, folder: str | None) -> Iterator[DiskDownloadArea | None]:
    """While the block runs, received results download to disk when ``enabled`` (else nothing changes).

    Args:
        context: The workflow's job context (its runtime does the switching).
        enabled: The workflow's ``download_to_disk`` arg.
        folder: The workflow's ``download_to_disk_dir`` arg; the runtime's default when None.

    Raises:
        PathOutsideError: ``folder`` lies outside the site's workspace and the folders the site
            allows (the runtime checks it; the message names ``download_to_disk_dir``).
    """
    if not enabled:
        yield None
        return
    with context.downloads_to_disk(None if folder is None else Path(folder)) as area:
        yield area


def check_download_dir(paths: JobPaths, enabled: bool, folder: str | None) -> None:
    """At job start: refuse a ``download_to_disk_dir`` outside the workspace and the allowed folders.

    Raises:
        PathOutsideError: It leaves them (the message names ``download_to_disk_dir``).
    """
    if enabled and folder is not None:
        paths.resolve_output(folder, "download_to_disk_dir")


def disk_figures(area: DiskDownloadArea | None, current_round: int) -> dict[str, Any]:
    """What a round reports of its downloads to disk: streams downloaded so far, bytes still on disk."""
    if area is None:
        return {}
    left = area.bytes_used()
    if left:
        log.warning(
            "downloaded files left after round %d: bytes=%d folder=%s", shown_round(current_round), left, area.folder
        )
    return {"disk_downloads": area.downloads, "disk_bytes_left": left}


def with_real_tensors(model: FLModel) -> FLModel:
    """``model`` with any lazy params read into memory (persistors only ever see real tensors)."""
    params = model.params or {}
    if not any(callable(getattr(value, "resolve", None)) for value in params.values()):
        return model
    return dataclasses.replace(model, params={name: resolve_value(value) for name, value in params.items()})
