"""A message's tensors pulled straight into tensors of the receiver's own (``MessageCodec.decode`` with
``place``, what ``flare.receive(into=net)`` uses): real cells over TCP loopback, small chunks."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from engine.client.into import fill_into, placement_of, targets_of
from engine.errors import IntoMismatchError
from engine.model import DXO, DataKind, FLModel, model_from_shareable, shareable_from_model
from engine.streaming.codec import MessageCodec

from .codec_pair import codec_pair

CHUNK_BYTES = 4096  # many chunks, some spanning two tensors


@dataclass
class Link:
    sender: MessageCodec
    receiver: MessageCodec

    def move(self, message: object, targets: dict[str, torch.Tensor]) -> object:
        frames = self.sender.encode(message, receivers=["site-1"])
        return self.receiver.decode(frames, sender="server", place=functools.partial(placement_of, targets=targets))


@pytest.fixture
def link() -> Iterator[Link]:
    with codec_pair(CHUNK_BYTES) as pair:
        yield Link(pair.sender, pair.receiver)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 30), nn.ReLU(), nn.Linear(30, 10))


def global_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return {name: torch.rand(t.shape, generator=generator) for name, t in module.state_dict().items()}


@pytest.mark.parametrize("carrier", ["flmodel", "dxo"])
def test_the_chunks_land_in_the_modules_own_tensors(link: Link, carrier: str) -> None:
    module = net()
    pointers = {name: t.data_ptr() for name, t in module.state_dict().items()}
    sent = global_weights(module)
    message = (
        shareable_from_model(FLModel(params=sent, current_round=2))
        if carrier == "flmodel"
        else DXO(DataKind.WEIGHTS, sent).to_shareable()
    )
    targets = targets_of(module)

    received = model_from_shareable(link.move(message, targets))

    for name, tensor in module.state_dict().items():
        assert received.params[name] is targets[name], f"{name} landed in new memory"
        assert tensor.data_ptr() == pointers[name]
        assert torch.equal(tensor, sent[name])
    assert fill_into(targets, received).params == targets  # nothing left to copy


@pytest.mark.parametrize(
    ("change", "message"),
    [
        pytest.param(lambda p: p.update({"2.weight": torch.zeros(10, 31)}), r"'2\.weight' arrived with shape", id="shape"),
        pytest.param(lambda p: p.update({"0.bias": torch.zeros(30, dtype=torch.float16)}), r"'0\.bias' arrived as torch\.float16", id="dtype"),
        pytest.param(lambda p: p.pop("2.bias"), r"missing from the task: '2\.bias'", id="missing"),
    ],
)  # fmt: skip
def test_a_mismatch_lands_in_new_memory_and_is_named_before_anything_is_written(link: Link, change, message) -> None:
    module = net()
    before = {name: t.clone() for name, t in module.state_dict().items()}
    sent = global_weights(module)
    change(sent)
    targets = targets_of(module)

    received = model_from_shareable(link.move(shareable_from_model(FLModel(params=sent)), targets))

    assert all(torch.equal(t, before[n]) for n, t in module.state_dict().items()), "a target was written"
    assert all(
        received.params[name].data_ptr() != t.data_ptr() for name, t in targets.items() if name in received.params
    )
    with pytest.raises(IntoMismatchError, match=message):
        fill_into(targets, received)
    assert all(torch.equal(t, before[n]) for n, t in module.state_dict().items())
