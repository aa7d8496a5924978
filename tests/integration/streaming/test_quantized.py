"""`Quantize` between real cells: a model's params cross TCP as fp16 / bf16 / int8 records and land as
values, in new memory, in a script's own tensors, on disk (``download_to_disk``) or as numpy arrays."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from engine import fobs
from engine.client.into import placement_of, targets_of
from engine.filters import Quantize
from engine.fobs.quantized import CODECS
from engine.model import FLModel, ParamsType, model_from_shareable, register_model_types, shareable_from_model
from engine.streaming.codec import MessageCodec
from engine.streaming.disk import DiskDownloads
from engine.streaming.lazy import LazyRef

from .codec_pair import CodecPair, codec_pair

CHUNK_BYTES = 64 * 1024


@pytest.fixture
def link() -> Iterator[CodecPair]:
    with codec_pair(CHUNK_BYTES) as pair:
        yield pair


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(300, 200), nn.BatchNorm1d(200), nn.Linear(200, 10))


def weights() -> dict[str, torch.Tensor]:
    return {name: t + 0.01 if t.is_floating_point() else t.clone() for name, t in net().state_dict().items()}


def within_bound(got: torch.Tensor, sent: torch.Tensor, mode: str) -> bool:
    if not sent.is_floating_point():
        return torch.equal(got, sent)
    largest = sent.abs().max().item() if sent.numel() else 0.0
    return (got - sent).abs().max().item() <= CODECS[mode].max_relative_error * largest * 1.0001


@pytest.mark.parametrize("mode", list(CODECS))
def test_a_quantized_model_crosses_in_fewer_bytes_and_comes_back_within_its_bound(link: CodecPair, mode: str) -> None:
    sent = weights()
    message = Quantize(mode).process(shareable_from_model(FLModel(params=sent, params_type=ParamsType.FULL)), "site-1")
    plain_bytes = sum(t.nbytes for t in sent.values())

    served_before = sum(link.service.bytes_served().values())
    received = model_from_shareable(link.receiver.decode(link.sender.encode(message, ["site-1"]), sender="server"))
    served = sum(link.service.bytes_served().values()) - served_before

    assert set(received.params) == set(sent)
    for name, tensor in sent.items():
        assert received.params[name].dtype == tensor.dtype and received.params[name].shape == tensor.shape
        assert within_bound(received.params[name], tensor, mode), name
    assert served < plain_bytes * {"int8": 0.27, "int4": 0.14}.get(mode, 0.52), served


def test_the_sender_keeps_its_own_model_unquantized(link: CodecPair) -> None:
    sent = weights()
    original = shareable_from_model(FLModel(params=sent))
    message = Quantize("int8").process(original, "site-1")
    link.receiver.decode(link.sender.encode(message, ["site-1"]), sender="server")

    assert model_from_shareable(original).params is sent
    assert all(isinstance(t, torch.Tensor) for t in sent.values())


def test_a_script_receives_the_values_straight_into_its_own_tensors(link: CodecPair) -> None:
    module = net()
    pointers = {name: t.data_ptr() for name, t in module.state_dict().items()}
    sent = weights()
    message = Quantize("bf16").process(shareable_from_model(FLModel(params=sent)), "site-1")
    targets = targets_of(module)

    frames = link.sender.encode(message, ["site-1"])
    received = model_from_shareable(
        link.receiver.decode(frames, sender="server", place=functools.partial(placement_of, targets=targets))
    )

    for name, tensor in module.state_dict().items():
        assert received.params[name] is targets[name], f"{name} landed in new memory"
        assert tensor.data_ptr() == pointers[name]
        assert within_bound(tensor, sent[name], "bf16"), name


def test_download_to_disk_gets_lazy_values_on_disk(link: CodecPair, tmp_path: Path) -> None:
    sent = weights()
    message = Quantize("int8").process(shareable_from_model(FLModel(params=sent)), "site-1")
    downloads = DiskDownloads(tmp_path / "downloads")
    downloads.open()
    try:
        frames = link.sender.encode(message, ["site-1"])
        from dataclasses import replace

        codec = MessageCodec(
            fobs_registry(), replace(link.receiver.context, consumer_factory=downloads.consumer_factory())
        )
        received = model_from_shareable(codec.decode(frames, sender="server"))
        assert all(isinstance(value, LazyRef) for value in received.params.values())
        for name, tensor in sent.items():
            assert within_bound(received.params[name].resolve(), tensor, "int8"), name
        assert downloads.downloads == 1
    finally:
        downloads.close()


def fobs_registry() -> fobs.Registry:
    registry = fobs.new_registry()
    register_model_types(registry)
    return registry


def test_numpy_arrays_come_back_as_numpy_arrays(link: CodecPair) -> None:
    sent = {"w": np.linspace(-1, 1, 5000, dtype=np.float32), "n": np.arange(4)}
    message = Quantize("fp16").process(shareable_from_model(FLModel(params=sent)), "site-1")
    received = model_from_shareable(link.receiver.decode(link.sender.encode(message, ["site-1"]), sender="server"))

    assert isinstance(received.params["w"], np.ndarray) and received.params["w"].dtype == np.float32
    assert np.abs(received.params["w"] - sent["w"]).max() <= 2**-11
    assert np.array_equal(received.params["n"], sent["n"])


def test_a_quantized_array_is_neither_folded_nor_placed(link: CodecPair) -> None:
    """It travels in the tensors' download but comes back as a numpy array: a fold (which leaves
    meta placeholders) or a script's own torch tensors cannot take it, so the peek says so."""
    sent = {"w": np.linspace(-1, 1, 5000, dtype=np.float32), "t": torch.linspace(-1, 1, 3000)}
    message = Quantize("int8").process(shareable_from_model(FLModel(params=sent)), "site-1")
    peeked: dict[str, bool] = {}

    def fold(header):  # the server's choice is made on this peek (engine.workflows.round_folding)
        peeked.update({name: item.is_tensor for name, item in model_from_shareable(header).params.items()})

    received = model_from_shareable(
        link.receiver.decode(link.sender.encode(message, ["site-1"]), sender="server", fold=fold)
    )

    assert peeked == {"w": False, "t": True}
    assert isinstance(received.params["w"], np.ndarray) and np.abs(received.params["w"] - sent["w"]).max() <= 1 / 127
    assert isinstance(received.params["t"], torch.Tensor)


def test_inline_tensors_travel_exactly(link: CodecPair) -> None:
    """With a chunk size of 0 nothing streams, so nothing is quantized."""
    inline = MessageCodec(fobs_registry(), replace(link.sender.context, tensor_chunk_bytes=0))
    sent = weights()
    message = Quantize("int8").process(shareable_from_model(FLModel(params=sent)), "site-1")
    received = model_from_shareable(link.receiver.decode(inline.encode(message, ["site-1"]), sender="server"))
    assert all(torch.equal(received.params[name], tensor) for name, tensor in sent.items())


def test_fp16_refuses_values_beyond_its_range_and_names_the_modes_that_fit() -> None:
    with pytest.raises(Exception, match="beyond float16's range .* bf16 or int8"):
        Quantize("fp16").process(shareable_from_model(FLModel(params={"w": torch.tensor([1e6])})), "site-1")
    with pytest.raises(ValueError, match="mode: expected one of fp16, bf16, int8, int4"):
        Quantize("nf4")
