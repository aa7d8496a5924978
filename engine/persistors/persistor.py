"""`ModelPersistor`: where a workflow's initial model comes from and its checkpoints go."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.errors import CheckpointError
from engine.model import FLModel
from engine.paths import JobPaths

#: Folder of the checkpoints, relative to the server's app folder.
MODELS_DIR_NAME = "models"


class ModelPersistor(ABC):
    """Loads the initial model and saves the global model after each round.

    The runtime calls `use_workspace` and then `use_job_paths` before the workflow runs;
    checkpoints then go to ``<app_dir>/models``, and any path the persistor's args name is
    checked against the folders the job may use. A file name arg (the checkpoint's) is checked
    with `engine.paths.plain_file_name` when the persistor is built, and with
    `engine.paths.no_link_out` in `use_workspace` (a symbolic link must not lead it out).

    Example:
        A persistor that starts from zeros and keeps nothing::

            class Zeros(ModelPersistor):
                def load_model(self) -> FLModel:
                    return FLModel(params={"w": torch.zeros(4)})

                def save_model(self, model: FLModel) -> Path:
                    return self.models_dir / "unsaved"
    """

    _models_dir: Path | None = None

    def use_workspace(self, app_dir: Path) -> None:
        """Save checkpoints under ``app_dir / "models"`` from now on (the folder is made on first save)."""
        self._models_dir = Path(app_dir) / MODELS_DIR_NAME

    def use_job_paths(self, paths: JobPaths) -> None:  # noqa: B027 - optional hook, nothing to do by default
        """Check and resolve the paths this persistor's args name (the runtime calls it at job start).

        A persistor that reads a file a job names (a checkpoint to start from) resolves it with
        ``paths.resolve(value, setting)``, so a job cannot make a site read outside the job
        folder, its workspace and the folders the site allows.

        Raises:
            PathOutsideError: A path leaves those folders (the message names the setting).
        """

    def global_params_for_reading(self) -> Mapping[str, Any]:
        """The current global model's params for reading a block at a time (as `load_model` gives them by default).

        A persistor that keeps the global model in a file can hand out references that read it
        on demand (``shape``, ``dtype``, ``read_elements``), so an aggregator that reads the
        global model beside each result does not hold a second model in memory.
        """
        return self.load_model().params or {}

    @property
    def models_dir(self) -> Path:
        """The folder checkpoints are saved in.

        Raises:
            RuntimeError: `use_workspace` was not called yet.
        """
        if self._models_dir is None:
            raise RuntimeError(f"{type(self).__name__} has no models folder yet: call use_workspace(app_dir) first")
        return self._models_dir

    @abstractmethod
    def load_model(self) -> FLModel:
        """Return the model the workflow starts from."""

    @abstractmethod
    def save_model(self, model: FLModel) -> Path:
        """Save ``model`` as the global model; return the file written.

        A persistor that also keeps a best model picks it by no metric that
        ``model.meta[MetaKey.METRICS_FROM_ONE_SITE]`` lists: one site alone decided its value.
        """

    def load_saved_model(self) -> FLModel:
        """The last global model `save_model` wrote in this run, read back (a Swarm round played again sends it).

        Raises:
            LookupError: This persistor cannot give it back (the default), or it saved none yet.
        """
        raise LookupError(f"{type(self).__name__} cannot give back the last model it saved")

    def load_starting_model(self) -> FLModel:
        """The model the run started from, read again (a Swarm first round played again sends it).

        Raises:
            LookupError: This persistor cannot read it again (the default): it handed its
                starting weights out and keeps no file of them.
        """
        raise LookupError(f"{type(self).__name__} cannot read the starting model again")

    def drop_initial_model(self) -> None:  # noqa: B027 - optional hook, nothing to do by default
        """This side will not start from the initial model (another site loads it): free it.

        `load_model` then returns only a model saved since. A Swarm client that is not the
        starting client calls it, so its memory does not hold a model it never sends.
        """

    def flush(self) -> None:  # noqa: B027 - optional hook, nothing to do by default
        """Return once every save is complete on disk; the runtime calls it when the workflows end.

        Raises:
            OSError: A save that finished in the background failed.
        """

    def saved_model_file(self) -> Path | None:
        """The file of the last saved global model, once it is on disk under its name; None if it keeps none.

        A workflow's checkpoint gives this file a second name (`engine.workflows.checkpoint`), so a
        persistor that returns None here cannot be resumed.
        """
        return None

    def resume_state(self) -> dict[str, Any]:
        """The persistor's own state a resumed run needs (JSON), e.g. the best key metric so far."""
        return {}

    def resume_from(self, model_file: Path, state: Mapping[str, Any]) -> None:
        """Make ``model_file`` (a checkpoint's global model) the current one, with ``state`` from `resume_state`.

        Raises:
            CheckpointError: This persistor cannot resume a run.
        """
        raise CheckpointError(f"{type(self).__name__} cannot resume a run: it keeps no global model file")
