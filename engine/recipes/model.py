"""The model of a recipe: a class's dotted path and its args, or a module instance (its class and weights).

The persistor builds the model from ``{ path, args }`` on the site that starts the training, so
a recipe needs the class's importable path and its constructor args. An instance gives the class,
not the args (a module does not remember them): ``model_args`` must come with it, and the
instance's weights are written next to the config as the persistor's starting checkpoint
(``source_ckpt_file_full_name``), so the job starts from exactly those weights.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.recipes.checks import config_dict

#: The starting checkpoint's file, in the app folder (the persistor reads relative paths from there).
INITIAL_CHECKPOINT = "initial_model.safetensors"
#: Seconds a fresh Python may take to say whether it finds a module.
_PROBE_TIMEOUT_S = 30.0
_DOTTED_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")


@dataclass
class ModelSpec:
    """What the persistor is given: the class path, its args, and the instance whose weights start the job.

    Attributes:
        path: The class's dotted path, e.g. ``net.Net``.
        args: Its keyword arguments.
        instance: The module whose weights are written as the starting checkpoint, or None.
    """

    path: str
    args: dict[str, Any] = field(default_factory=dict)
    instance: Any = None

    def config(self) -> dict[str, Any]:
        """The ``model`` arg of the persistor: ``{ path, args }``."""
        return {"path": self.path, "args": dict(self.args)}


def model_spec(model: Any, model_args: Mapping[str, Any] | None, custom_names: set[str]) -> ModelSpec:
    """Check ``model`` and ``model_args`` and return what the persistor needs.

    Args:
        model: A class's dotted path (``net.Net``), or a ``torch.nn.Module`` instance whose class
            the job can import: from its custom files (``custom_names``) or from an installed package.
        model_args: The class's keyword arguments; required with an instance.
        custom_names: The top-level module names the job's custom files provide (``net`` for net.py).

    Raises:
        TypeError: ``model`` is neither; ``model_args`` is not a dict of config values.
        ValueError: A bad dotted path; an instance without ``model_args``, of a class the job
            cannot import, or whose class built with ``model_args`` has other tensors.
    """
    args = config_dict("model_args", model_args)
    if isinstance(model, str):
        if not _DOTTED_PATH.fullmatch(model):
            raise ValueError(f"model: expected a dotted path module.Class (e.g. 'net.Net'), got {model!r}")
        return ModelSpec(model, args)
    torch = _torch_if_module(model)
    if torch is None:
        raise TypeError(
            f"model: expected a dotted path 'module.Class' or a torch.nn.Module instance, got {type(model).__name__}"
        )
    if model_args is None:
        raise ValueError(
            f"model: a {type(model).__name__} instance does not tell its constructor's arguments; pass model_args "
            "(e.g. model_args={'hidden': 64}, or {} when it takes none)"
        )
    path = _class_path(type(model), custom_names)
    _check_same_tensors(torch, model, args)
    return ModelSpec(path, args, model)


def write_checkpoint(instance: Any, path: Path) -> None:
    """Write the instance's ``state_dict()`` to ``path`` as safetensors (CPU, contiguous, no shared storage)."""
    import safetensors.torch

    tensors = {}
    storages: set[int] = set()
    for name, value in instance.state_dict().items():
        tensor = value.detach().to("cpu").contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        if pointer != 0 and pointer in storages:
            tensor = tensor.clone()  # tied weights: safetensors refuses one storage under two names
        storages.add(tensor.untyped_storage().data_ptr())
        tensors[name] = tensor
    safetensors.torch.save_file(tensors, path)


def _torch_if_module(model: Any) -> Any:
    """The torch module when ``model`` is a ``torch.nn.Module`` (torch is imported only for a non-string)."""
    import torch

    return torch if isinstance(model, torch.nn.Module) else None


def _class_path(cls: type, custom_names: set[str]) -> str:
    module, name = cls.__module__, cls.__qualname__
    if module == "__main__" or "<locals>" in name:
        raise ValueError(
            f"model: class {name} is defined in {'a function' if '<locals>' in name else 'the running script'}, "
            "which the job's processes cannot import; move it to a module (e.g. net.py), add that file to "
            "custom_files and import it from there"
        )
    top = module.split(".")[0]
    if top in custom_names or _installed(top):
        return f"{module}.{name}"
    raise ValueError(
        f"model: class {module}.{name} comes from {_origin(cls)}, which the job does not carry; add that file "
        "(or its package folder) to custom_files, or install it"
    )


def _installed(top: str) -> bool:
    """Whether the job's processes can import module ``top`` without the job's files.

    Asked of a fresh Python with this one's environment, started in an empty folder, as the
    simulator starts the job's processes: what this process imports from the folder of the
    script that runs it, or from a path added at run time, is not found there.
    """
    if top in sys.builtin_module_names or top == "engine":
        return True
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec(sys.argv[1]) else 3)"
    with tempfile.TemporaryDirectory(prefix="flengine-recipe-") as empty:
        try:
            done = subprocess.run(
                [sys.executable, "-c", probe, top],
                cwd=empty,
                capture_output=True,
                timeout=_PROBE_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0


def _origin(cls: type) -> str:
    """The file ``cls`` was defined in, as far as can be told, else its module's name."""
    file = getattr(sys.modules.get(cls.__module__), "__file__", None)
    if file is None:  # its module was forgotten (as job_code_on_path does): ask its methods
        codes = (getattr(item, "__code__", None) for item in vars(cls).values())
        file = next((code.co_filename for code in codes if code is not None), None)
    return str(file) if file else f"module {cls.__module__!r}"


def _check_same_tensors(torch: Any, model: Any, args: dict[str, Any]) -> None:
    """Build the class with ``args`` on the meta device (no memory) and compare names and shapes."""
    try:
        with torch.device("meta"):
            probe = type(model)(**args)
    except Exception as e:
        raise ValueError(f"model_args: {type(model).__name__}(**{args!r}) failed: {e}") from e
    expected = {name: tuple(t.shape) for name, t in probe.state_dict().items()}
    actual = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if expected != actual:
        different = sorted(set(expected) ^ set(actual)) or [n for n in expected if expected[n] != actual[n]]
        raise ValueError(
            f"model_args: {type(model).__name__}(**{args!r}) has other tensors than the instance given "
            f"(first difference: {different[0]!r}); pass the args the instance was built with"
        )
