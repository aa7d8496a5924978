"""A job: its folder read, checked against the schemas, and dry-built, with every problem found.

`inspect_job` gathers all problems of a job at once (the job is returned only when there are
none); `load_job` raises them as one `ConfigError`; `validate_job` returns just the problems.

Each takes two switches for a job that arrives from someone else (a server's submissions, a
site's deployments): ``build=False`` imports and constructs nothing of the job, so its code does
not run in the daemon that checks it; ``environment=False`` refuses a ``${NAME}`` that the job's
files do not define instead of reading it from the daemon's environment.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config.build import ComponentSpec, check_component, is_nested_component
from engine.config.custom_files import check_custom_files
from engine.config.jobcode import job_code_on_path
from engine.config.key_metric import check_key_metric_ranges
from engine.config.layout import AppLayout, JobLayout, discover_layout
from engine.config.problems import KeyPath, Problem
from engine.config.schema import check_document, with_defaults
from engine.config.source import ConfigDocument, load_config
from engine.errors import ConfigError, IncludeRefused

ALL_SITES = "@ALL"
SERVER_SITE = "server"


@dataclass
class AppConfig:
    """One app of a job: its folder, its own code, and its parsed configs (defaults filled in).

    Attributes:
        name: The app folder's name.
        folder: The app folder.
        custom_dir: The app's ``custom/`` folder, put on ``sys.path`` while the job runs.
        server: ``config_fed_server``, if the app has one.
        client: ``config_fed_client``, if the app has one.
    """

    name: str
    folder: Path
    custom_dir: Path | None
    server: ConfigDocument | None = None
    client: ConfigDocument | None = None


@dataclass
class Job:
    """A valid job folder, ready to be run.

    Attributes:
        folder: The job folder.
        meta: The parsed meta file, defaults filled in (``name`` defaults to the folder's name).
        apps: The apps named in ``deploy_map``, by name.
    """

    folder: Path
    meta: ConfigDocument
    apps: dict[str, AppConfig] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The job's name."""
        return self.meta.data["name"]

    @property
    def min_clients(self) -> int:
        """The fewest clients the job needs."""
        return self.meta.data["min_clients"]

    def app_for(self, site: str) -> AppConfig | None:
        """Return the app deployed to ``site`` (``server`` or a client name), or None."""
        deploy_map = self.meta.data["deploy_map"]
        named = [app for app, sites in deploy_map.items() if site in sites]
        everyone = [app for app, sites in deploy_map.items() if ALL_SITES in sites]
        candidates = named or everyone
        return self.apps[candidates[0]] if candidates else None


def inspect_job(
    path: str | os.PathLike[str], *, build: bool = True, environment: bool = True
) -> tuple[Job | None, list[Problem]]:
    """Read and check a job folder: layout, schemas, deploy map, ids, and a dry build of components.

    Args:
        path: The job folder.
        build: Dry-build every component: import its dotted path (the app's ``custom/`` folder on
            ``sys.path``) and bind its args to the signature. False checks everything that needs
            no import, so none of the job's code runs: what a server or a site does with a job
            it receives (the job process builds it later, where the site's policy allows).
        environment: Let ``${NAME}`` / ``${?NAME}`` read what the job's files do not define from
            the process environment, as HOCON does. False makes it a problem instead: a job sent
            to a server may not read that server's environment.

    Returns:
        The job (None when anything is wrong) and every problem found, in order.
    """
    display = os.fspath(path)
    layout, problems = discover_layout(Path(path), display)
    if layout.meta_file is None:
        return None, problems

    meta = _load_checked(layout.meta_file, layout, "meta", problems, environment)
    apps = {
        name: _inspect_app(app, layout, problems, build=build, environment=environment)
        for name, app in layout.apps.items()
    }
    if meta is not None:
        meta.data = with_defaults(meta.data, "meta")
        meta.data.setdefault("name", layout.folder.resolve().name)
        problems.extend(_check_deploy_map(meta, layout))
    if problems or meta is None:
        return None, problems
    deployed = {name: apps[name] for name in meta.data["deploy_map"]}
    return Job(layout.folder, meta, deployed), []


def load_job(path: str | os.PathLike[str], *, build: bool = True, environment: bool = True) -> Job:
    """Read and check a job folder; raise `ConfigError` listing every problem if it is not valid.

    ``build`` and ``environment`` are `inspect_job`'s.
    """
    job, problems = inspect_job(path, build=build, environment=environment)
    if job is None:
        raise ConfigError(problems)
    return job


def validate_job(path: str | os.PathLike[str], *, build: bool = True, environment: bool = True) -> list[Problem]:
    """Return every problem of a job folder (an empty list when it is valid); see `inspect_job`."""
    return inspect_job(path, build=build, environment=environment)[1]


def _load_checked(
    file: Path, layout: JobLayout, schema: str, problems: list[Problem], environment: bool
) -> ConfigDocument | None:
    """Load ``file`` and check it against ``schema``; add problems; return it when schema-valid."""
    try:
        document = load_config(file, layout.display_of(file), layout.folder, environment=environment)
    except IncludeRefused as e:  # the rest of the file is still checked, so nothing hides behind it
        found = check_document(e.partial, schema) if e.partial is not None else []
        problems.extend(sorted([*e.problems, *_not_missing(found)], key=lambda p: p.line or 0))
        return None
    except ConfigError as e:
        problems.extend(e.problems)
        return None
    schema_problems = check_document(document, schema)
    problems.extend(schema_problems)
    return None if schema_problems else document


def _inspect_app(
    app: AppLayout, layout: JobLayout, problems: list[Problem], *, build: bool, environment: bool
) -> AppConfig:
    result = AppConfig(app.name, app.folder, app.custom_dir)
    for side, file in (("server", app.server_config), ("client", app.client_config)):
        if file is None:
            continue
        schema = f"config_fed_{side}"
        try:
            document = load_config(file, layout.display_of(file), layout.folder, environment=environment)
        except IncludeRefused as e:  # the rest of the file is still checked, so nothing hides behind it
            found = _check_app_config(e.partial, schema, app, build) if e.partial is not None else []
            problems.extend(sorted([*e.problems, *_not_missing(found)], key=lambda p: p.line or 0))
            continue
        except ConfigError as e:
            problems.extend(e.problems)
            continue
        problems.extend(_check_app_config(document, schema, app, build))
        document.data = with_defaults(document.data, schema)
        setattr(result, side, document)
    return result


def _check_app_config(document: ConfigDocument, schema: str, app: AppLayout, build: bool) -> list[Problem]:
    """The problems of a loaded server or client config: schema, ids, components (built when ``build``)."""
    found = check_document(document, schema) + _check_ids(document) + check_key_metric_ranges(document)
    if build:
        found += _dry_build(document, app.custom_dir, reported={problem.key_path for problem in found})
    else:
        found += [
            problem
            for spec in _component_specs(document)
            for problem in check_custom_files(spec, document, app.custom_dir, build=False)
        ]
    return sorted(found, key=lambda p: p.line or 0)


def _not_missing(problems: list[Problem]) -> list[Problem]:
    """``problems`` less those about something missing: a refused include may have been what brings it."""
    return [problem for problem in problems if not problem.message.startswith("missing")]


def _dry_build(document: ConfigDocument, custom_dir: Path | None, reported: set[KeyPath]) -> list[Problem]:
    """Check every component of ``document`` against its class: this imports the job's code.

    Args its class says name a file in custom/ (`engine.config.custom_files`) are checked too.
    """
    found = []
    with job_code_on_path(custom_dir):
        for spec in _component_specs(document):
            # a key the schema already faulted (a workflow arg it knows) is said once
            found.extend(p for p in check_component(spec, document) if p.key_path not in reported)
            found.extend(check_custom_files(spec, document, custom_dir, build=True))
    return found


def component_entries(data: dict[str, Any]) -> Iterator[tuple[KeyPath, Any]]:
    """Yield ``(key path, entry)`` for every component entry of a server or client config."""
    for key in ("workflows", "components"):
        for i, entry in enumerate(_as_list(data.get(key))):
            yield (key, i), entry
    for i, item in enumerate(_as_list(data.get("executors"))):
        if isinstance(item, dict):
            yield ("executors", i, "executor"), item.get("executor")
    for key in ("task_data_filters", "task_result_filters"):
        for i, chain in enumerate(_as_list(data.get(key))):
            filters = chain.get("filters") if isinstance(chain, dict) else None
            for j, entry in enumerate(_as_list(filters)):
                yield (key, i, "filters", j), entry


def _component_specs(document: ConfigDocument) -> Iterator[ComponentSpec]:
    """Yield a spec for each entry well-formed enough to dry-build (the schema reports the rest)."""
    for key_path, entry in component_entries(document.data):
        if isinstance(entry, dict) and is_nested_component({k: v for k, v in entry.items() if k != "id"}):
            if isinstance(entry.get("args", {}), dict):
                yield ComponentSpec.from_entry(entry, key_path)


def _check_ids(document: ConfigDocument) -> list[Problem]:
    first_seen: dict[str, KeyPath] = {}
    problems = []
    for key_path, entry in component_entries(document.data):
        component_id = entry.get("id") if isinstance(entry, dict) else None
        if not isinstance(component_id, str):
            continue
        if component_id in first_seen:
            line = document.line_of(first_seen[component_id] + ("id",))
            where = f", first used at line {line}" if line else ""
            message = f"duplicate id {component_id!r}{where}"
            problems.append(document.problem(key_path + ("id",), message, "ids must be unique in a config file"))
        else:
            first_seen[component_id] = key_path
    return problems


def _check_deploy_map(meta: ConfigDocument, layout: JobLayout) -> list[Problem]:
    problems = []
    server_apps = []
    for app_name, sites in meta.data["deploy_map"].items():
        key_path = ("deploy_map", app_name)
        app = layout.apps.get(app_name)
        if app is None:
            existing = ", ".join(sorted(layout.apps)) or "none"
            hint = f"app folders in {layout.display}: {existing}"
            problems.append(meta.problem(key_path, f"no app folder {app_name!r} with a config/ folder", hint))
            continue
        to_server = SERVER_SITE in sites or ALL_SITES in sites
        to_clients = ALL_SITES in sites or any(site != SERVER_SITE for site in sites)
        if to_server:
            server_apps.append(app_name)
            if app.server_config is None:
                problems.append(
                    meta.problem(
                        key_path, f"app {app_name!r} goes to the server but has no config/config_fed_server.conf"
                    )
                )
        if to_clients and app.client_config is None:
            problems.append(
                meta.problem(key_path, f"app {app_name!r} goes to clients but has no config/config_fed_client.conf")
            )
    if not server_apps:
        problems.append(
            meta.problem(
                ("deploy_map",), "no app is deployed to the server", 'add "server" or "@ALL" to one app\'s sites'
            )
        )
    elif len(server_apps) > 1:
        problems.append(
            meta.problem(
                ("deploy_map",),
                f"apps {', '.join(server_apps)} are all deployed to the server",
                "deploy exactly one app to the server",
            )
        )
    return problems


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []
