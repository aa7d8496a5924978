"""`PTFileModelPersistor`: a PyTorch model's weights in safetensors files, written atomically."""

from __future__ import annotations

import logging
import math
import numbers
import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from engine.errors import CheckpointError
from engine.model import FLModel, MetaKey, ParamsType
from engine.paths import JobPaths, no_link_out, plain_file_name
from engine.persistors.checkpoint_files import (
    TEMP_SUFFIX,
    CheckpointCommits,
    remove_stale_temp_files,
    write_safetensors_temp,
)
from engine.persistors.persistor import ModelPersistor
from engine.persistors.saved_tensors import saved_tensor_refs

logger = logging.getLogger(__name__)


class PTFileModelPersistor(ModelPersistor):
    """Start from a torch module's weights (or a checkpoint); save each global model as safetensors.

    Each save writes a temp file in the models folder and returns; flushing it to disk and
    renaming it over the old file happen in the background while the workflow goes on (the next
    save, `load_model` and `flush` wait for it). A crash never leaves a half-written checkpoint,
    and temp files a crash left behind are deleted by `use_workspace`. Nothing is pickled.

    Args:
        model: The model, already built from its ``{path, args}`` config entry.
        global_model_file_name: File name of the latest global model in the models folder
            (``<site workspace>/models``): a name alone, no folder, ``..`` or absolute path.
        best_global_model_file_name: File name of the best global model so far, by ``key_metric``
            (a name alone, as above).
        key_metric: Metric that decides the best model (higher is better).
        negate_key_metric: Lower is better instead (e.g. a loss).
        source_ckpt_file_full_name: A safetensors file to start from instead of the module's
            own weights; its names and shapes must match the module's ``state_dict()``. In a
            job it must lie in the job folder (relative paths start at the app folder), the
            site's workspace, or a folder the site allows (``flengine run --allow-dir``); the
            runtime checks it at job start (`use_job_paths`).

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
        ValueError: A file name is empty.
        PathOutsideError: A file name has a folder in it, is ``..`` or is absolute.

    Example:
        In ``config_fed_server.conf``::

            { id = persistor, path = engine.persistors.PTFileModelPersistor,
              args { model { path = model.Net, args { hidden = 64 } }, key_metric = accuracy } }
    """

    def __init__(
        self,
        model: torch.nn.Module,
        global_model_file_name: str = "global.safetensors",
        best_global_model_file_name: str = "best_global.safetensors",
        key_metric: str = "accuracy",
        negate_key_metric: bool = False,
        source_ckpt_file_full_name: str | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"model: expected a torch.nn.Module (a {{path, args}} entry that builds one), "
                f"got {type(model).__name__}"
            )
        self._model = model
        self._global_name = plain_file_name(global_model_file_name, "global_model_file_name", "the models folder")
        self._best_name = plain_file_name(
            best_global_model_file_name, "best_global_model_file_name", "the models folder"
        )
        self._key_metric = key_metric
        self._negate = negate_key_metric
        self._source = None if source_ckpt_file_full_name is None else Path(source_ckpt_file_full_name)
        self._best: float | None = None
        self._metrics_seen: set[str] = set()  # every metric name a saved model carried
        self._handed_out = False
        self._saved = False  # a global model was saved by this run
        self._commits = CheckpointCommits()

    def use_workspace(self, app_dir: Path) -> None:
        """Save checkpoints under ``app_dir / "models"``; delete temp files a crashed run left there.

        Raises:
            PathOutsideError: A symbolic link leads the models folder or a checkpoint file out of
                ``app_dir`` (the message names the file name's setting); nothing was deleted.
        """
        super().use_workspace(app_dir)
        self._check_no_link_out()
        for path in remove_stale_temp_files(self.models_dir, [self._global_name, self._best_name]):
            logger.warning("deleted the temp file of a checkpoint never completed: %s", path)

    def _check_no_link_out(self) -> None:
        """Raise `PathOutsideError` if a symbolic link leads a checkpoint file out of the workspace."""
        workspace = self.models_dir.parent  # the app_dir given to use_workspace
        for setting, name in (
            ("global_model_file_name", self._global_name),
            ("best_global_model_file_name", self._best_name),
        ):
            no_link_out(self.models_dir / name, workspace, setting, "the site's workspace")

    def use_job_paths(self, paths: JobPaths) -> None:
        """Resolve ``source_ckpt_file_full_name`` inside the folders the job may use (at job start).

        Raises:
            PathOutsideError: The checkpoint (symlinks resolved) lies outside the job folder, the
                site's workspace and the folders the site allows.
        """
        if self._source is not None:
            self._source = paths.resolve(self._source, "source_ckpt_file_full_name")

    def flush(self) -> None:
        """Return once every saved checkpoint is on disk under its name.

        Raises:
            OSError: A checkpoint could not be written; the message names the file. The file
                under that name is the previous checkpoint, intact.
        """
        self._commits.wait()

    def trainable_param_names(self) -> list[str]:
        """Names of the module's trainable floating-point parameters (``requires_grad``), in order.

        Read from the module's layout (it works after its weights were handed out); SCAFFOLD's
        server keeps a control variate for each.
        """
        return [
            name
            for name, param in self._model.named_parameters()
            if param.requires_grad and param.dtype.is_floating_point
        ]

    def drop_initial_model(self) -> None:
        """Free the module's weights (names and shapes stay, to check what is loaded and saved)."""
        if self._source is None and not self._handed_out:
            self._model.to("meta")
            self._handed_out = True

    def load_model(self) -> FLModel:
        """Return the current global model as FULL params: the last one saved, else the starting weights.

        The starting weights are the checkpoint's, else the module's. The module's tensors are
        handed over without a copy, and the module keeps only their names and shapes from then
        on (its weights would otherwise stay in memory for the whole job); a later call
        therefore reads the last saved global model.

        Raises:
            FileNotFoundError: ``source_ckpt_file_full_name`` names no file.
            ValueError: The checkpoint is not a safetensors file, or does not match the module.
            RuntimeError: The module's weights were handed out and no global model was saved since.
            OSError: The last save failed (see `flush`).
        """
        self.flush()
        saved = self._models_dir / self._global_name if self._models_dir is not None else None
        if (self._handed_out or self._saved) and saved is not None and saved.is_file():
            return self._load_file(saved, "global model")
        if self._source is None:
            if self._handed_out:
                raise RuntimeError("load_model: the module's weights were handed out and no global model was saved yet")
            params = {name: t.detach().cpu() for name, t in self._model.state_dict().items()}
            self._model.to("meta")  # keep names and shapes, not a second model's worth of memory
            self._handed_out = True
            return FLModel(params=params, params_type=ParamsType.FULL)
        return self._load_file(self._source, "source_ckpt_file_full_name")

    def load_saved_model(self) -> FLModel:
        """The last global model saved in this run, read back from its file (FULL params).

        Raises:
            LookupError: No global model was saved yet in this run.
            OSError: The last save failed (see `flush`).
        """
        self.flush()
        saved = self._models_dir / self._global_name if self._models_dir is not None else None
        if not self._saved or saved is None or not saved.is_file():
            raise LookupError("no global model was saved yet in this run")
        return self._load_file(saved, "global model")

    def load_starting_model(self) -> FLModel:
        """The starting checkpoint read again (``source_ckpt_file_full_name``), FULL params.

        Raises:
            LookupError: The job names no starting checkpoint: the starting weights were the
                module's, handed out once (`load_model`) and kept nowhere.
            FileNotFoundError, ValueError: As `load_model`.
        """
        if self._source is None:
            raise LookupError(
                "the starting weights were the module's, handed out once and kept nowhere; name a starting "
                "checkpoint (source_ckpt_file_full_name) for the first round to be played again after a loss"
            )
        return self._load_file(self._source, "source_ckpt_file_full_name")

    def global_params_for_reading(self) -> Mapping[str, Any]:
        """The last saved global model as references into its file (read a block at a time).

        Before the first save this is `load_model`'s params. The references read the file by
        name: valid until the next `save_model` renames a new checkpoint over it.
        """
        self.flush()
        saved = self._models_dir / self._global_name if self._models_dir is not None else None
        if self._saved and saved is not None and saved.is_file():
            refs = saved_tensor_refs(saved)
            self._check_matches_module(refs, saved, "global model")
            return refs
        return self.load_model().params or {}

    def _load_file(self, path: Path, what: str) -> FLModel:
        """The safetensors file ``path`` as FULL params in the module's order, checked against it."""
        if not path.is_file():
            raise FileNotFoundError(f"{what}: no such file: {path}")
        try:
            params = safetensors.torch.load_file(path)
        except Exception as e:  # safetensors raises its own SafetensorError for a bad header
            raise ValueError(f"{what}: {path} is not a readable safetensors file: {e}") from e
        self._check_matches_module(params, path, what)
        params = {name: params[name] for name in self._model.state_dict()}  # the module's order
        logger.info("model loaded: file=%s tensors=%d", path, len(params))
        return FLModel(params=params, params_type=ParamsType.FULL)

    def _check_matches_module(self, params: Mapping[str, torch.Tensor], path: Path, what: str) -> None:
        expected = self._model.state_dict()
        problems = [f"missing {name!r}" for name in expected if name not in params]
        problems += [f"unexpected {name!r}" for name in params if name not in expected]
        problems += [
            f"{name!r}: shape {tuple(t.shape)}, the model's is {tuple(expected[name].shape)}"
            for name, t in params.items()
            if name in expected and t.shape != expected[name].shape
        ]
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise ValueError(f"{what}: {path} does not match the model: {shown}")

    def save_model(self, model: FLModel) -> Path:
        """Write ``model.params`` as the global model; also as the best one when it is the best so far.

        The model is the best so far when ``model.metrics[key_metric]`` beats every earlier one
        (is lower, with ``negate_key_metric``) and more than one site's value went into it (the
        workflow lists the metrics one site alone decided in ``meta[MetaKey.METRICS_FROM_ONE_SITE]``,
        see `engine.aggregators.rules.metrics_from_one_site`). The best file is a second name of
        the same file, not a second write. Tensors are copied to contiguous CPU memory one at a
        time; numpy arrays are converted. Returns once the file is written and the tensors are no
        longer needed; the file takes its name once it is on disk (see `flush`).

        Returns:
            The global model file.

        Raises:
            ValueError: The model has no params, or DIFF params.
            TypeError: A param is neither a tensor nor a numpy array.
            RuntimeError: `use_workspace` was not called.
            PathOutsideError: A symbolic link made since `use_workspace` leads the models folder
                or a checkpoint file out of the workspace; nothing was written.
            OSError: Writing failed, now or in the previous save; the file under the global
                model's name is left as it was.
        """
        if model.params is None:
            raise ValueError("cannot save a model without params")
        if model.params_type == ParamsType.DIFF:
            raise ValueError("cannot save DIFF params as the global model: apply the difference to the model first")
        tensors = _savable_tensors(model.params)
        models_dir = self.models_dir
        self._check_no_link_out()  # again: a link may have appeared since the start
        models_dir.mkdir(parents=True, exist_ok=True)
        path = models_dir / self._global_name
        self.flush()  # the previous checkpoint first: renames never overtake each other
        temp = write_safetensors_temp(tensors, path)
        del tensors
        moves = [(temp, path)]
        self._metrics_seen.update(str(name) for name in (model.metrics or {}))
        score = self._score(model.metrics, model.meta)
        if score is not None and (self._best is None or score > self._best):
            try:
                moves.append((_second_name(temp, models_dir / self._best_name), models_dir / self._best_name))
            except OSError:
                temp.unlink(missing_ok=True)
                raise
            self._best = score
            best = model.metrics[self._key_metric]
            logger.info("best global model: file=%s %s=%s", moves[1][1], self._key_metric, best)
        self._commits.commit(moves)
        self._saved = True
        logger.info("global model saved: file=%s", path)
        return path

    def saved_model_file(self) -> Path | None:
        """The global model file, once the last save is on disk under its name; None before the first save.

        Raises:
            OSError: The last save failed (see `flush`).
        """
        self.flush()
        if not self._saved or self._models_dir is None:
            return None
        return self._models_dir / self._global_name

    def resume_state(self) -> dict[str, Any]:
        """The best key metric so far (as this persistor scores it) and the metric names seen."""
        return {"best": self._best, "metrics_seen": sorted(self._metrics_seen)}

    def resume_from(self, model_file: Path, state: Mapping[str, Any]) -> None:
        """Make ``model_file`` the global model (a copy under the global model's name); restore the best score.

        Raises:
            CheckpointError: The file does not match the model, or the state is malformed.
        """
        best = state.get("best")
        if best is not None and (isinstance(best, bool) or not isinstance(best, (int, float))):
            raise CheckpointError(f"resume: the persistor's best score is not a number: {best!r}")
        try:
            self._check_matches_module(saved_tensor_refs(model_file), model_file, "checkpoint model")
        except ValueError as e:
            raise CheckpointError(str(e)) from e
        path = self.models_dir / self._global_name
        self.models_dir.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(path.name + ".resume-tmp")
        temp.unlink(missing_ok=True)
        shutil.copyfile(model_file, temp)  # a copy: the checkpoint's file stays as it was
        os.replace(temp, path)
        self._best = None if best is None else float(best)
        self._metrics_seen.update(str(name) for name in state.get("metrics_seen") or [])
        self._saved = True
        self.drop_initial_model()
        logger.info("resumed from checkpoint model: file=%s best=%s", model_file, self._best)

    def end_of_run_warnings(self) -> list[str]:
        """Say, once the run is over, when ``key_metric`` never came with a saved model (no best model was written).

        Returns:
            One line naming the metrics that did come, e.g. ``key_metric 'acuracy' was never
            reported; reported metrics: global_accuracy, local_accuracy (...)``; empty when the
            key metric came, or when no model was saved at all (the run failed for another reason).
        """
        if not self._saved or self._key_metric in self._metrics_seen:
            return []
        reported = ", ".join(sorted(self._metrics_seen)) or "none"
        return [
            f"key_metric {self._key_metric!r} was never reported; reported metrics: {reported} "
            f"(no {self._best_name} was written: set key_metric to one of them)"
        ]

    def _score(self, metrics: Mapping[str, Any] | None, meta: Mapping[str, Any] | None = None) -> float | None:
        """The key metric as a higher-is-better score, or None when the model has none that may count.

        A key metric that one site alone decided (listed in the model's
        ``MetaKey.METRICS_FROM_ONE_SITE`` meta by the workflow) does not count: one site must
        not pick the best model.
        """
        value = (metrics or {}).get(self._key_metric)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
            logger.warning("key metric is not a number, best model not updated: %s=%r", self._key_metric, value)
            return None
        from_one_site = (meta or {}).get(MetaKey.METRICS_FROM_ONE_SITE)
        if isinstance(from_one_site, (list, tuple, set, frozenset)) and self._key_metric in from_one_site:
            logger.warning(
                "best model not updated: key metric from one site alone: %s=%r (no other site's value "
                "counted this round; a best model is chosen only by a value two or more sites reported)",
                self._key_metric,
                value,
            )
            return None
        return -float(value) if self._negate else float(value)


def _savable_tensors(params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``params`` as contiguous CPU tensors that share no memory (safetensors refuses shared storage)."""
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()  # data pointers of the CPU storages used so far
    for name, value in params.items():
        if isinstance(value, np.ndarray):
            if value.dtype == object:
                raise TypeError(f"params[{name!r}]: a numpy array of Python objects cannot be saved")
            value = torch.from_numpy(np.ascontiguousarray(value) if value.flags.writeable else value.copy())
        elif not isinstance(value, torch.Tensor):
            raise TypeError(f"params[{name!r}]: expected a torch.Tensor or numpy.ndarray, got {type(value).__name__}")
        tensor = value.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if storage != 0 and storage in storages:
            tensor = tensor.clone()  # tied weights: one storage under two names
            storage = tensor.untyped_storage().data_ptr()
        storages.add(storage)
        tensors[name] = tensor
    return tensors


def _second_name(temp: Path, target: Path) -> Path:
    """A temp name for ``target`` that is a hard link to ``temp`` (a copy where links are not possible)."""
    second = target.parent / f".{target.name}.{secrets.token_hex(6)}{TEMP_SUFFIX}"
    try:
        os.link(temp, second)
    except OSError:
        shutil.copyfile(temp, second)
    return second
