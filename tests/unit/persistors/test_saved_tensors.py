"""Reading a saved checkpoint a block at a time: `saved_tensor_refs` and the persistor's `global_params_for_reading`."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.model import FLModel
from engine.persistors import PTFileModelPersistor
from engine.persistors.saved_tensors import SavedTensorRef, saved_tensor_refs


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(40, 30)


def test_refs_read_any_block_of_every_tensor(tmp_path: Path) -> None:
    tensors = {"a": torch.randn(7, 9), "b": torch.arange(10, dtype=torch.int64), "c": torch.randn(8).half()}
    save_file(tensors, tmp_path / "m.safetensors")

    refs = saved_tensor_refs(tmp_path / "m.safetensors")

    assert set(refs) == set(tensors)
    for name, tensor in tensors.items():
        ref = refs[name]
        assert ref.shape == tuple(tensor.shape) and ref.dtype == tensor.dtype
        assert torch.equal(ref.resolve(), tensor)
        flat = tensor.reshape(-1)
        block = ref.read_elements(3, torch.empty(4, dtype=tensor.dtype))
        assert torch.equal(block, flat[3:7])
    with pytest.raises(ValueError, match="lie outside tensor 'b'"):
        refs["b"].read_elements(8, torch.empty(4, dtype=torch.int64))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x01", "shorter than its header length"),
        (struct.pack("<Q", 2**40), "a header of 1099511627776 bytes"),
        (struct.pack("<Q", 3) + b"{x}", "its header is not JSON"),
        (struct.pack("<Q", 2) + b"[]", "its header is not an object"),
    ],
)
def test_a_damaged_checkpoint_is_refused_naming_it(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        saved_tensor_refs(path)


def test_a_tensor_that_does_not_fit_the_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "short.safetensors"
    save_file({"w": torch.zeros(100)}, path)
    path.write_bytes(path.read_bytes()[:-40])  # truncated
    with pytest.raises(ValueError, match=r"tensor 'w' does not fit the file"):
        saved_tensor_refs(path)


def test_the_persistor_hands_out_references_to_the_last_saved_model(tmp_path: Path) -> None:
    persistor = PTFileModelPersistor(model=Net())
    persistor.use_workspace(tmp_path)
    initial = persistor.global_params_for_reading()  # nothing saved yet: the module's weights
    assert all(isinstance(value, torch.Tensor) for value in initial.values())

    saved = {"fc.weight": torch.full((30, 40), 2.0), "fc.bias": torch.full((30,), 3.0)}
    persistor.save_model(FLModel(params=saved))
    refs = persistor.global_params_for_reading()

    assert all(isinstance(value, SavedTensorRef) for value in refs.values())
    assert torch.equal(refs["fc.weight"].resolve(), saved["fc.weight"])
    assert torch.equal(refs["fc.bias"].read_elements(10, torch.empty(5)), torch.full((5,), 3.0))
