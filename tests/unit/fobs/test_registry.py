"""Registry.replace: a layer swaps how a type travels, explicitly and strictly."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine import fobs
from engine.errors import UnknownTypeError
from engine.fobs.arrays import TensorDecomposer


class ShoutingTensorDecomposer(TensorDecomposer):
    def wire_name(self) -> str:
        return "test.LoudTensor"

    def recompose(self, data: Any, ctx: fobs.DecodeContext) -> torch.Tensor:
        return super().recompose(data, ctx) * 2


def test_replace_swaps_the_decomposer_and_its_wire_name() -> None:
    registry = fobs.new_registry()

    old = registry.replace(ShoutingTensorDecomposer())
    header, frames = fobs.serialize(torch.ones(2), registry=registry)

    assert type(old) is TensorDecomposer
    assert torch.equal(fobs.deserialize(header, frames, registry=registry), torch.full((2,), 2.0))
    assert registry.wire_name(registry.for_type(torch.nn.Parameter)) == "test.LoudTensor"  # subclasses follow
    with pytest.raises(UnknownTypeError, match=r"'torch.Tensor'"):
        registry.for_name("torch.Tensor")


def test_replace_needs_something_to_replace() -> None:
    with pytest.raises(ValueError, match=r"no decomposer for Tensor is registered, so none can be replaced"):
        fobs.Registry().replace(ShoutingTensorDecomposer())


def test_replace_refuses_a_taken_wire_name() -> None:
    class Impostor(TensorDecomposer):
        def wire_name(self) -> str:
            return "builtins.tuple"

    with pytest.raises(ValueError, match=r"wire name 'builtins.tuple' is already taken"):
        fobs.new_registry().replace(Impostor())


def test_a_copy_changes_independently_of_its_original() -> None:
    original = fobs.new_registry()
    twin = original.copy()

    twin.replace(ShoutingTensorDecomposer())

    assert isinstance(twin.for_type(torch.Tensor), ShoutingTensorDecomposer)
    assert not isinstance(original.for_type(torch.Tensor), ShoutingTensorDecomposer)
