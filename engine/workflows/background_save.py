"""`BackgroundSave`: a round's model checkpointed in a thread of its own while the clients download it."""

from __future__ import annotations

import threading
from collections.abc import Callable

from engine.model import FLModel


class BackgroundSave:
    """``save(model)`` in a thread of its own, so the clients download the model meanwhile; then ``after()``.

    Args:
        save: Writes the model (the persistor's save).
        model: The model; only its params, type, metrics and meta are kept, until the save is over.
        after: Called in the same thread once the save succeeded (the round's resume checkpoint);
            it must not raise.
    """

    def __init__(
        self, save: Callable[[FLModel], None], model: FLModel, after: Callable[[], None] | None = None
    ) -> None:
        self._error: BaseException | None = None
        self._saved = threading.Event()
        self._model: FLModel | None = FLModel(
            params=model.params, params_type=model.params_type, metrics=model.metrics, meta=model.meta
        )
        self._thread = threading.Thread(target=self._run, args=(save, after), name="round-save", daemon=True)
        self._thread.start()

    def _run(self, save: Callable[[FLModel], None], after: Callable[[], None] | None) -> None:
        model, self._model = self._model, None
        try:
            assert model is not None
            save(model)
        except BaseException as e:  # noqa: BLE001 - raised by wait() in the workflow's thread
            self._error = e
            return
        finally:
            del model  # the weights are on disk: this thread does not keep them alive while it checkpoints
            self._saved.set()
        if after is not None:
            after()

    def join(self) -> None:
        """Return once the save is over (written or failed); the checkpoint after it may still be written."""
        self._saved.wait()

    def wait(self) -> None:
        """Return once the save and what follows it are over; raise the save's error if it failed."""
        self._thread.join()
        if self._error is not None:
            raise self._error
