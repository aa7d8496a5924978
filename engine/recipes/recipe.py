"""`Recipe`: a job described in Python, written out as an ordinary job folder and run in the simulator.

The job folder is the source of truth: `Recipe.export` writes ``meta.conf``,
``app/config/config_fed_{server,client}.conf`` (HOCON) and ``app/custom/`` exactly as one would
by hand, reads every config back to check it means what the recipe was given, and validates the
folder as ``flengine validate`` does. `Recipe.run` exports into a folder and runs it with
`engine.runtime.simulator.run_simulation`, as ``flengine run`` does.

Subclasses (`FedAvgRecipe`, `SwarmRecipe`, ...) say which workflows, executors and components the
algorithm needs; everything shared (the model and its persistor, the training script and its
files, streaming settings, extra components and filters) lives here.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from engine.config import load_config, validate_job
from engine.config.new_job import is_plain_name, refuse_used_folder, write_files
from engine.errors import ConfigError, UsageError
from engine.recipes import checks
from engine.recipes.custom import custom_contents, custom_entries, custom_module_names
from engine.recipes.hocon import hocon_text
from engine.recipes.model import INITIAL_CHECKPOINT, ModelSpec, model_spec, write_checkpoint

if TYPE_CHECKING:
    from engine.runtime.simulator import SimulationResult

SERVER_CONFIG = "app/config/config_fed_server.conf"
CLIENT_CONFIG = "app/config/config_fed_client.conf"
META = "meta.conf"
PERSISTOR_ID = "persistor"
#: The ``quantize`` arguments of the recipes: `engine.filters.Quantize`'s modes (tests check they match).
QUANTIZE_MODES = ("fp16", "bf16", "int8", "int4")
_FILTER_KINDS = ("task_data", "task_result")


@dataclass(frozen=True)
class SimEnv:
    """Where `Recipe.execute` runs a job: the simulator on this machine (NVIDIA FLARE's ``SimEnv``).

    Attributes:
        num_clients: Clients to start; the recipe's ``num_clients`` by default.
        workspace: A new or empty folder for logs, models and ``summary.json``; default
            ``workspace/<job>-<time>`` under the current folder.
        verbose: Debug logging in every process.
        allowed_dirs: Folders outside the workspace the job's paths may name (``--allow-dir``).
    """

    num_clients: int | None = None
    workspace: str | os.PathLike[str] | None = None
    verbose: bool = False
    allowed_dirs: Sequence[str | os.PathLike[str]] = ()


class Recipe(ABC):
    """What every recipe takes: the model, the training script and its files, rounds and clients.

    Args:
        name: The job's name (letters, digits, ``.``, ``_``, ``-``); the algorithm's by default.
        model: The model: a class's dotted path (``net.Net``, importable from ``custom_files``
            or an installed package), or a ``torch.nn.Module`` instance of such a class (then
            ``model_args`` is required, and the job starts from the instance's weights as they
            are at export).
        model_args: The class's keyword arguments, e.g. ``{"hidden": 64}``.
        train_script: The training script (Client API), copied into ``app/custom/``.
        train_args: Its command-line arguments, a string (``"--epochs 2"``) or a list.
        custom_files: More files or folders copied into ``app/custom/`` (the model's module,
            data, helpers); each keeps its name.
        num_rounds: Rounds of training.
        num_clients: Clients the job needs (``min_clients``); `run` starts this many by default.
        key_metric: The metric that picks the best model (higher is better); the persistor's
            default (``accuracy``) when None.
        execution_mode: ``in_process`` (a thread of the client) or ``subprocess``.
        initial_checkpoint: A safetensors file to start from (names and shapes of the model's
            ``state_dict()``), copied into the app folder; not with a model instance.
    """

    #: The job name when none is given.
    default_name = "job"
    #: What the config headers say wrote them.
    recipe_name = "Recipe"

    def __init__(
        self,
        *,
        model: Any,
        train_script: str | os.PathLike[str],
        name: str | None = None,
        model_args: Mapping[str, Any] | None = None,
        train_args: str | Sequence[str] = "",
        custom_files: Sequence[str | os.PathLike[str]] = (),
        num_rounds: int = 1,
        num_clients: int = 2,
        key_metric: str | None = None,
        execution_mode: str = "in_process",
        initial_checkpoint: str | os.PathLike[str] | None = None,
    ) -> None:
        self.name = self._job_name(self.default_name if name is None else name)
        self.num_rounds = checks.positive_int("num_rounds", num_rounds, minimum=self._min_rounds())
        self.num_clients = checks.positive_int("num_clients", num_clients)
        self.train_script = checks.existing_file("train_script", train_script)
        self.train_args = checks.script_args(train_args)
        self.custom = custom_entries(self.train_script, custom_files)
        self.model: ModelSpec = model_spec(model, model_args, custom_module_names(self.custom))
        self.key_metric = None if key_metric is None else checks.text("key_metric", key_metric)
        self.execution_mode = checks.choice("execution_mode", execution_mode, ("in_process", "subprocess"))
        self.initial_checkpoint = None
        if initial_checkpoint is not None:
            if self.model.instance is not None:
                raise ValueError(
                    "initial_checkpoint: the model instance's weights already start the job; give one or the other"
                )
            self.initial_checkpoint = checks.existing_file("initial_checkpoint", initial_checkpoint)
        self._settings: dict[str, dict[str, Any]] = {"server": {}, "client": {}}
        self._components: dict[str, list[dict[str, Any]]] = {"server": [], "client": []}
        self._filters: dict[str, dict[str, list[dict[str, Any]]]] = {
            side: {kind: [] for kind in _FILTER_KINDS} for side in ("server", "client")
        }

    # ------------------------------------------------------------------ additions

    def add_server_config(self, config: Mapping[str, Any]) -> None:
        """Set top-level keys of ``config_fed_server.conf``: streaming settings, ``cell``.

        Example:
            >>> recipe.add_server_config({"tensor_download_chunk_size": 4194304, "streaming_per_request_timeout": 300})

        Raises:
            ValueError, TypeError: A key the schema does not know, a key the recipe writes itself
                (workflows, components, filters: use the recipe's arguments and methods), or a
                value the schema refuses; the message names the key.
        """
        self._settings["server"].update(checks.top_level_settings("server", config))

    def add_client_config(self, config: Mapping[str, Any]) -> None:
        """Set top-level keys of ``config_fed_client.conf`` (see `add_server_config`)."""
        self._settings["client"].update(checks.top_level_settings("client", config))

    def add_server_component(self, id: str, path: str, args: Mapping[str, Any] | None = None) -> None:  # noqa: A002
        """Add ``{ id, path, args }`` to the server's ``components`` (e.g. for a workflow arg naming it)."""
        self._add_component("server", id, path, args)

    def add_client_component(self, id: str, path: str, args: Mapping[str, Any] | None = None) -> None:  # noqa: A002
        """Add ``{ id, path, args }`` to the clients' ``components``."""
        self._add_component("client", id, path, args)

    def add_server_filter(
        self,
        path: str,
        args: Mapping[str, Any] | None = None,
        *,
        kind: str = "task_result",
        tasks: Sequence[str] = ("*",),
    ) -> None:
        """Add a filter on the server: ``kind`` ``task_data`` (tasks it sends) or ``task_result`` (results it gets)."""
        self._add_filter("server", path, args, kind, tasks)

    def add_client_filter(
        self,
        path: str,
        args: Mapping[str, Any] | None = None,
        *,
        kind: str = "task_result",
        tasks: Sequence[str] = ("*",),
    ) -> None:
        """Add a filter on every client: ``task_data`` (tasks it receives) or ``task_result`` (results it sends).

        Example:
            >>> recipe.add_client_filter("engine.filters.ExcludeVars", {"exclude_vars": ["fc2.bias"]})
        """
        self._add_filter("client", path, args, kind, tasks)

    # ------------------------------------------------------------------ output

    def configs(self) -> dict[str, dict[str, Any]]:
        """The three documents the job folder holds, by relative path (what `export` writes)."""
        server = {"format_version": 2, **self._settings["server"]}
        workflows, server_components = self._server_side()
        server.update(
            workflows=workflows,
            components=[*server_components, *self._components["server"]],
            **{f"{kind}_filters": self._filters["server"][kind] for kind in _FILTER_KINDS},
        )
        client = {"format_version": 2, **self._settings["client"]}
        executors, client_components = self._client_side()
        client.update(
            executors=executors,
            components=[*client_components, *self._components["client"]],
            **{f"{kind}_filters": self._filters["client"][kind] for kind in _FILTER_KINDS},
        )
        meta = {
            "name": self.name,
            "min_clients": self.num_clients,
            "deploy_map": {"app": ["@ALL"]},
            "resource_spec": {},
        }
        return copy.deepcopy(
            {META: meta, SERVER_CONFIG: server, CLIENT_CONFIG: client}
        )  # the recipe's own stay its own

    def export(self, folder: str | os.PathLike[str], *, overwrite: bool = False, validate: bool = True) -> Path:
        """Write the job folder and return it.

        Args:
            folder: A new or empty folder.
            overwrite: Replace what ``folder`` holds; only a job folder (one with ``meta.conf``
                or ``meta.json``) is replaced, anything else is refused.
            validate: Check the written job as ``flengine validate`` does.

        Raises:
            UsageError: ``folder`` is not empty (without ``overwrite``), or not a job folder.
            ConfigError: The written job is not valid (every problem, with file and line); the
                folder is left as written, to look at.
        """
        target = Path(folder)
        if overwrite and target.is_dir() and any(target.iterdir()):
            if not ((target / "meta.conf").is_file() or (target / "meta.json").is_file()):
                raise UsageError(
                    f"{target}: overwrite=True replaces only a job folder (with meta.conf); this is not one"
                )
            shutil.rmtree(target)
        refuse_used_folder(target, "choose another folder or pass overwrite=True")
        documents = self.configs()
        header = (
            f"Written by engine.recipes.{self.recipe_name}; an ordinary job folder: edit it, or change the "
            "recipe and export again."
        )
        contents: dict[str, bytes | Path] = {
            path: hocon_text(data, [header]).encode("utf-8") for path, data in documents.items()
        }
        contents.update({f"app/custom/{name}": source for name, source in custom_contents(self.custom).items()})
        if self.initial_checkpoint is not None:
            contents[f"app/{INITIAL_CHECKPOINT}"] = self.initial_checkpoint
        write_files(target, contents)
        if self.model.instance is not None:
            write_checkpoint(self.model.instance, target / "app" / INITIAL_CHECKPOINT)
        for path, data in documents.items():
            _check_read_back(target, path, data)
        if validate:
            problems = validate_job(target)
            if problems:
                raise ConfigError(problems)
        return target

    def run(
        self,
        workspace: str | os.PathLike[str] | None = None,
        num_clients: int | None = None,
        *,
        job_folder: str | os.PathLike[str] | None = None,
        out: IO[str] | None = None,
        verbose: bool = False,
        allowed_dirs: Sequence[str | os.PathLike[str]] = (),
    ) -> SimulationResult:
        """Export the job and run it in the simulator (``flengine run``); return how it ended.

        Args:
            workspace: A new or empty folder for logs, models and ``summary.json``; by default
                ``workspace/<name>-<time>`` under the current folder.
            num_clients: Clients to start (``site-1`` ..); the recipe's ``num_clients`` by default.
            job_folder: Where the job folder is written (kept); a temporary folder, removed
                after the run, by default.
            out: Where progress and the summary are printed (stdout by default).
            verbose: Debug logging in every process.
            allowed_dirs: Folders outside the workspace the job's paths may name.

        Returns:
            The result: ``state`` (``JobState.FINISHED_COMPLETED`` when it completed),
            ``workspace`` and ``summary`` (what ``summary.json`` holds).
        """
        from engine.runtime.simulator import run_simulation  # zmq and the runtime load only to run

        clients = self.num_clients if num_clients is None else checks.positive_int("num_clients", num_clients)
        if job_folder is not None:
            folder = self.export(job_folder)
            return run_simulation(folder, clients, workspace, out=out, verbose=verbose, allowed_dirs=allowed_dirs)
        with tempfile.TemporaryDirectory(prefix=f"flengine-{self.name}-") as temp:
            folder = self.export(Path(temp) / self.name)
            return run_simulation(folder, clients, workspace, out=out, verbose=verbose, allowed_dirs=allowed_dirs)

    def execute(self, env: SimEnv) -> SimulationResult:
        """Run the job in ``env`` (NVIDIA FLARE's ``recipe.execute(SimEnv(num_clients=2))``); see `run`."""
        if not isinstance(env, SimEnv):
            raise TypeError(f"env: expected a SimEnv, got {type(env).__name__}")
        return self.run(env.workspace, env.num_clients, verbose=env.verbose, allowed_dirs=env.allowed_dirs)

    # ------------------------------------------------------------------ for subclasses

    def _min_rounds(self) -> int:
        return 1

    @abstractmethod
    def _server_side(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The server's workflows and components."""

    @abstractmethod
    def _client_side(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The clients' executors and components."""

    def _reserved_ids(self, side: str) -> set[str]:
        """Component ids the recipe itself uses on ``side``."""
        return {PERSISTOR_ID}

    def persistor(self) -> dict[str, Any]:
        """The persistor component: the model from ``{ path, args }``, the starting checkpoint, the key metric."""
        args: dict[str, Any] = {"model": self.model.config()}
        if self.key_metric is not None:
            args["key_metric"] = self.key_metric
        if self.model.instance is not None or self.initial_checkpoint is not None:
            args["source_ckpt_file_full_name"] = INITIAL_CHECKPOINT
        return {"id": PERSISTOR_ID, "path": "engine.persistors.PTFileModelPersistor", "args": args}

    def script_executor(self, tasks: Sequence[str]) -> dict[str, Any]:
        """The executor entry that runs the training script for ``tasks``."""
        args = {
            "task_script_path": self.train_script.name,
            "task_script_args": self.train_args,
            "execution_mode": self.execution_mode,
        }
        return {"tasks": list(tasks), "executor": {"path": "engine.executors.ClientAPIExecutor", "args": args}}

    # ------------------------------------------------------------------ helpers

    def _job_name(self, name: Any) -> str:
        if not isinstance(name, str) or not is_plain_name(name):
            raise ValueError(
                f"name: expected a plain job name (letters, digits, '.', '_', '-', not starting with '.' or '-'), "
                f"got {name!r}"
            )
        return name

    def _add_component(self, side: str, id: str, path: str, args: Mapping[str, Any] | None) -> None:  # noqa: A002
        where = f"add_{side}_component"
        checks.component_id(f"{where}: id", id)
        taken = self._reserved_ids(side) | {c["id"] for c in self._components[side]}
        if id in taken:
            raise ValueError(f"{where}: id {id!r} is taken (the recipe's or an earlier one's); pick another id")
        entry = {
            "id": id,
            "path": checks.dotted_path(f"{where}: path", path),
            "args": checks.config_dict(f"{where}: args", args),
        }
        self._components[side].append(entry)

    def _add_filter(
        self, side: str, path: str, args: Mapping[str, Any] | None, kind: str, tasks: Sequence[str]
    ) -> None:
        where = f"add_{side}_filter"
        checks.choice(f"{where}: kind", kind, _FILTER_KINDS)
        names = checks.task_names(f"{where}: tasks", tasks)
        entry = {"path": checks.dotted_path(f"{where}: path", path), "args": checks.config_dict(f"{where}: args", args)}
        self._filters[side][kind].append({"tasks": names, "filters": [entry]})


def _check_read_back(folder: Path, path: str, data: dict[str, Any]) -> None:
    """Read a written config back as the engine does; it must hold exactly ``data``."""
    try:
        document = load_config(folder / path, path, folder, environment=False)
    except ConfigError as e:
        raise RuntimeError(f"{folder / path}: the config written cannot be read back: {e}") from e
    if document.data != data:
        raise RuntimeError(f"{folder / path}: the config written reads back differently from what the recipe holds")
