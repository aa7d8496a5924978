"""The server optimizer's state on disk (FedOpt with download_to_disk): the same steps as in
memory, read and written a block at a time against a global model read from its checkpoint, and
its folder gone once closed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine.model import ParamsType
from engine.persistors.saved_tensors import saved_tensor_refs
from engine.workflows.optimizer_state import FileState, MemoryState
from engine.workflows.server_optimizer import ServerOptimizer

SHAPES = {"a": (50, 7), "b": (13,), "half": (9, 3)}


def _initial() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    params = {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}
    params["half"] = params["half"].to(torch.float16)
    return params


def _means(current_round: int, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A FULL mean: the global model moved by a random amount."""
    generator = torch.Generator().manual_seed(10 + current_round)
    return {
        name: (value.float() + 0.1 * torch.randn(value.shape, generator=generator)).to(value.dtype)
        for name, value in params.items()
    }


def _rounds(tmp_path: Path, optimizer: ServerOptimizer, state, block_bytes: int) -> dict[str, torch.Tensor]:
    """Three rounds, the global model saved and read back from a checkpoint each time (as FedOpt does)."""
    params = _initial()
    for current_round in range(3):
        checkpoint = tmp_path / f"global-{current_round}.safetensors"
        save_file(params, checkpoint)
        mean = _means(current_round, params)
        params = optimizer.apply(mean, ParamsType.FULL, saved_tensor_refs(checkpoint), state, block_bytes)
    return params


def _numpy_adam(optimizer: ServerOptimizer) -> dict[str, np.ndarray]:
    """Adam in float64 numpy, following the model's rounding to float16 for ``half``."""
    params = _initial()
    m = {name: np.zeros(shape) for name, shape in SHAPES.items()}
    v = {name: np.zeros(shape) for name, shape in SHAPES.items()}
    for current_round in range(3):
        mean = _means(current_round, params)
        new = {}
        for name, value in params.items():
            x = value.double().numpy()
            d = mean[name].double().numpy() - x
            m[name] = optimizer.beta1 * m[name] + (1 - optimizer.beta1) * d
            v[name] = optimizer.beta2 * v[name] + (1 - optimizer.beta2) * d**2
            stepped = x + optimizer.lr * m[name] / (np.sqrt(v[name]) + optimizer.epsilon)
            new[name] = torch.from_numpy(stepped).to(value.dtype)
        params = new
    return {name: value.double().numpy() for name, value in params.items()}


def test_state_in_files_steps_as_in_memory_and_as_the_formula(tmp_path: Path) -> None:
    optimizer = ServerOptimizer.from_args("adam", 0.05)
    block_bytes = 64  # 16 float32 elements a block: every tensor spans several blocks
    on_disk = FileState(tmp_path / "workspace", block_elements=16)

    from_files = _rounds(tmp_path, optimizer, on_disk, block_bytes)
    files = sorted(path.name for path in on_disk.folder.iterdir())
    sizes = {path.name: path.stat().st_size for path in on_disk.folder.iterdir()}
    in_memory = _rounds(tmp_path, optimizer, MemoryState(), block_bytes)
    on_disk.close()

    numel = sum(int(np.prod(shape)) for shape in SHAPES.values())
    assert files == ["m", "v"] and sizes == {"m": 4 * numel, "v": 4 * numel}  # float32 state, every element
    assert list((tmp_path / "workspace").iterdir()) == []  # closing deleted the state's folder
    expected = _numpy_adam(optimizer)
    for name in SHAPES:
        assert from_files[name].dtype == _initial()[name].dtype
        assert torch.equal(from_files[name], in_memory[name]), name
        tolerance = 2e-3 if name == "half" else 1e-5
        np.testing.assert_allclose(from_files[name].double().numpy(), expected[name], atol=tolerance, err_msg=name)


def test_a_state_block_outside_its_tensor_is_refused(tmp_path: Path) -> None:
    state = FileState(tmp_path, block_elements=8)
    try:
        state.block("m", "w", 10, torch.float32, 0, 8)
        with pytest.raises(ValueError, match="lies outside it or is too large"):
            state.block("m", "w", 10, torch.float32, 8, 8)
        with pytest.raises(ValueError, match="now has 12 elements"):
            state.block("m", "w", 12, torch.float32, 0, 4)
    finally:
        state.close()
    assert list(tmp_path.iterdir()) == []
