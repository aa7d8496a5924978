"""Payloads over msgpack's 4 GiB limit travel, because big buffers never enter msgpack."""

from __future__ import annotations

import pytest
import torch

from engine import fobs


@pytest.mark.slow
def test_payload_over_4_gib_round_trips() -> None:
    size = 4 * 2**30 + 2**20
    embedding = torch.empty(size, dtype=torch.uint8)
    embedding[:: 2**20] = 7  # one mark per MiB, checked below without a second 4 GiB buffer
    embedding[-1] = 9

    header, frames = fobs.serialize({"embedding": embedding})
    back = fobs.deserialize(header, frames)["embedding"]

    assert len(header) < 1024
    assert back.shape == embedding.shape
    assert torch.equal(back[:: 2**20], embedding[:: 2**20])
    assert back[-1].item() == 9
