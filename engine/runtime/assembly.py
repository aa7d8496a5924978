"""Building a side's components from its validated config: components, workflows, executors, filters."""

from __future__ import annotations

import contextlib
import fnmatch
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import ComponentSpec, ConfigDocument, Job, KeyPath, build_component
from engine.errors import ConfigError, FilterError, PathOutsideError
from engine.fobs.tensor_pool import DEFAULT_IDLE_RELEASE_S, TENSOR_POOL
from engine.model import Shareable
from engine.paths import JobPaths
from engine.streaming.via_downloader import DEFAULT_CHUNK_BYTES

log = logging.getLogger(__name__)


def build_entries(document: ConfigDocument, key: str) -> dict[str, Any]:
    """Build every ``{id, path, args}`` entry of ``document.data[key]``, by id, in order."""
    built = {}
    for i, entry in enumerate(document.data.get(key, [])):
        spec = ComponentSpec.from_entry(entry, (key, i))
        built[spec.id or f"{key}[{i}]"] = build_component(spec, document)
    return built


def prepare_components(
    components: Mapping[str, Any],
    document: ConfigDocument,
    workspace: Path,
    paths: JobPaths,
    key: str = "components",
) -> None:
    """Call each component's ``use_workspace(workspace)`` and ``use_job_paths(paths)`` hooks, if it has them.

    The runtime calls it at job start, before anything runs, for the ``components`` of a config,
    and can for its ``workflows`` the same way (``key="workflows"``): a path an entry's args
    name is then refused before the first round, at its file, line and key.

    Args:
        components: The entries built from ``document.data[key]``, by id, in their order.
        document: The config they were built from (for the file and line in messages).
        workspace: This site's folder of the job's workspace.
        paths: The folders the job's paths may name on this site.
        key: The config key the entries come from (``components`` or ``workflows``).

    Raises:
        ConfigError: A path an entry's args name leaves the folders it must stay in; the message
            names the file, line and key path (``components[0].args.<setting>``), and the
            `PathOutsideError` is its cause.
    """
    for index, component in enumerate(components.values()):
        with _located(document, (key, index, "args")):
            if callable(getattr(component, "use_workspace", None)):
                component.use_workspace(workspace)
            if callable(getattr(component, "use_job_paths", None)):
                component.use_job_paths(paths)


def prepare_executors(routes: Sequence[ExecutorRoute], document: ConfigDocument, paths: JobPaths) -> None:
    """Call each executor's ``use_job_paths(paths)`` hook, if it has one (at job start, before ``initialize``).

    Raises:
        ConfigError: A path an executor's args name leaves the folders it must stay in; the
            message names the file, line and key path (``executors[0].executor.args.<setting>``),
            and the `PathOutsideError` is its cause.
    """
    for index, route in enumerate(routes):
        if callable(getattr(route.executor, "use_job_paths", None)):
            with _located(document, ("executors", index, "executor", "args")):
                route.executor.use_job_paths(paths)


@contextlib.contextmanager
def _located(document: ConfigDocument, args_path: KeyPath) -> Iterator[None]:
    """Turn a `PathOutsideError` into a `ConfigError` at ``args_path + (setting,)`` of ``document``."""
    try:
        yield
    except PathOutsideError as e:
        raise ConfigError([document.problem((*args_path, e.setting), e.detail)]) from e


@dataclass
class ExecutorRoute:
    """The executor that runs the tasks whose names match ``tasks`` (``*`` matches all)."""

    tasks: list[str]
    executor: Any

    def matches(self, task_name: str) -> bool:
        return any(fnmatch.fnmatchcase(task_name, pattern) for pattern in self.tasks)


def build_executors(document: ConfigDocument) -> list[ExecutorRoute]:
    """Build the ``executors`` of a client config, in order."""
    routes = []
    for i, item in enumerate(document.data.get("executors", [])):
        spec = ComponentSpec.from_entry(item["executor"], ("executors", i, "executor"))
        routes.append(ExecutorRoute(list(item["tasks"]), build_component(spec, document)))
    return routes


def route_task(routes: Sequence[ExecutorRoute], task_name: str) -> Any | None:
    """The executor of the first route whose task names match ``task_name``."""
    return next((route.executor for route in routes if route.matches(task_name)), None)


@dataclass
class FilterChains:
    """The ``task_data_filters`` or ``task_result_filters`` of a config, applied in order."""

    chains: list[tuple[list[str], list[Any]]] = field(default_factory=list)

    @classmethod
    def build(cls, document: ConfigDocument, key: str) -> FilterChains:
        chains = []
        for i, chain in enumerate(document.data.get(key, [])):
            filters = [
                build_component(ComponentSpec.from_entry(entry, (key, i, "filters", j)), document)
                for j, entry in enumerate(chain.get("filters", []))
            ]
            chains.append((list(chain["tasks"]), filters))
        return cls(chains)

    def __bool__(self) -> bool:
        return any(filters for _, filters in self.chains)

    def same_for_every_site(self, task_name: str) -> bool:
        """Whether every filter that applies to ``task_name`` says it ignores the site (see `Filter`)."""
        return all(
            getattr(item, "same_for_every_site", False) is True
            for patterns, filters in self.chains
            if any(fnmatch.fnmatchcase(task_name, p) for p in patterns)
            for item in filters
        )

    def apply(self, task_name: str, shareable: Shareable, site: str) -> Shareable:
        """Run every filter whose chain names ``task_name``; raise `FilterError` naming a failing one."""
        for patterns, filters in self.chains:
            if not any(fnmatch.fnmatchcase(task_name, p) for p in patterns):
                continue
            for item in filters:
                try:
                    shareable = item.process(shareable, site)
                except Exception as e:
                    raise FilterError(f"filter {type(item).__name__} failed on task {task_name!r}: {e}") from e
                if not isinstance(shareable, Shareable):
                    raise FilterError(
                        f"filter {type(item).__name__} returned {type(shareable).__name__}, not a Shareable"
                    )
        return shareable


#: The config keys that decide how tensors stream (see `StreamingContext.from_config`).
STREAMING_KEYS = (
    "tensor_download_chunk_size",
    "np_download_chunk_size",
    "streaming_per_request_timeout",
    "streaming_max_requests_in_flight",
    "streaming_min_throughput",
    "streaming_retries",
    "streaming_retry_backoff_s",
)


def streaming_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The streaming settings of a validated config (the `STREAMING_KEYS` it sets)."""
    return {key: config[key] for key in STREAMING_KEYS if key in config}


def configure_tensor_pool(config: dict[str, Any]) -> None:
    """Apply a validated config's ``tensor_pool_idle_release_s`` to this process's tensor pool."""
    TENSOR_POOL.configure(config.get("tensor_pool_idle_release_s", DEFAULT_IDLE_RELEASE_S))


#: The config keys that set the size of streamed chunks.
CHUNK_SIZE_KEYS = ("tensor_download_chunk_size", "np_download_chunk_size")


def largest_chunk_bytes(job: Job) -> int:
    """The largest chunk that any config of ``job`` streams, in bytes (0: everything inline).

    Every config counts, not only a site's own: a process receives chunks of the size its
    senders chose (a server those of every client app, a client those of the server and, in a
    swarm, of other clients).
    """
    sizes = [0]
    for app in job.apps.values():
        for document in (app.server, app.client):
            if document is not None:
                sizes += [document.data.get(key, DEFAULT_CHUNK_BYTES) for key in CHUNK_SIZE_KEYS]
    return max(sizes)
