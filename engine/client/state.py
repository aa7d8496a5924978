"""`ClientState`: what a training script remembers for its site across rounds, kept in the site's folder.

A script's loop may run once for the whole job (a client process) or once per task (a virtual
client of ``flengine run -t``, which a worker runs turn by turn with other clients). Anything
that must survive from one round to the next — SCAFFOLD's control variate, a local model for
cross-site evaluation, a counter — goes here, not in module globals, so the script works the
same both ways (and after its client process is started again)::

    state = flare.client_state()
    seen = state.load("rounds_seen", 0)
    state.save("rounds_seen", seen + 1)
    state.save_tensors("c_local", {"w": torch.zeros(3)})
    c_local = state.load_tensors("c_local")   # None the first time

Values are JSON (``save``/``load``) or tensors (``save_tensors``/``load_tensors``, as
safetensors; never pickle). Each write goes to a temporary file that replaces the old one, so a
crash leaves the last complete value. Names are plain words (letters, digits, ``_``, ``-``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from engine.errors import ClientAPIError

#: The folder of a site's state, under its workspace folder.
STATE_FOLDER = "state"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ClientState:
    """One site's saved values, in ``folder`` (created on the first save).

    Args:
        folder: The site's state folder (``<site workspace>/state``).
    """

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    def save(self, name: str, value: Any) -> None:
        """Keep ``value`` (anything JSON can hold) as ``name``.

        Raises:
            ClientAPIError: A bad name, or a value JSON cannot hold.
        """
        try:
            text = json.dumps(value)
        except (TypeError, ValueError) as e:
            raise ClientAPIError(f"client_state().save({name!r}): not a JSON value ({e}); use save_tensors") from e
        self._write(self._path(name, ".json"), text.encode("utf-8"))

    def load(self, name: str, default: Any = None) -> Any:
        """The value saved as ``name``, or ``default`` when there is none."""
        path = self._path(name, ".json")
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return default
        except ValueError as e:
            raise ClientAPIError(f"client_state(): {path} is not JSON ({e}); delete it to start over") from e

    def save_tensors(self, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Keep ``tensors`` (name -> tensor) as ``name``, as a safetensors file (copied to the CPU)."""
        path = self._path(name, ".safetensors")
        self.folder.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.tmp")
        cpu = {key: tensor.detach().to("cpu").contiguous() for key, tensor in tensors.items()}
        save_file(cpu, str(temporary))
        os.replace(temporary, path)

    def load_tensors(self, name: str) -> dict[str, torch.Tensor] | None:
        """The tensors saved as ``name`` (on the CPU), or None when there are none."""
        path = self._path(name, ".safetensors")
        if not path.is_file():
            return None
        try:
            return load_file(str(path))
        except Exception as e:  # safetensors raises its own error types
            raise ClientAPIError(
                f"client_state(): {path} is not a safetensors file ({e}); delete it to start over"
            ) from e

    def _path(self, name: str, suffix: str) -> Path:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ClientAPIError(f"client_state(): {name!r} is not a state name; use 1-64 letters, digits, '_' or '-'")
        return self.folder / f"{name}{suffix}"

    def _write(self, path: Path, data: bytes) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_bytes(data)
        os.replace(temporary, path)
