"""The hooks a downloader plugs into: per-message post-callbacks that add datums, datum handlers."""

from __future__ import annotations

from typing import Any

import pytest

from engine import fobs

GATHERED = 100  # a datum type of this test's own


class Blob:
    """Something big that should travel once per message, gathered with its siblings."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload


class GatheringBlobDecomposer(fobs.Decomposer[Blob]):
    """Replaces each Blob by an index and sends all payloads of a message as one datum."""

    def supported_type(self) -> type[Blob]:
        return Blob

    def decompose(self, obj: Blob, ctx: fobs.EncodeContext) -> Any:
        gathered = ctx.state.setdefault("blobs", [])
        gathered.append(obj.payload)
        ctx.add_post_callback("blobs", self._add_datum)
        return len(gathered) - 1

    @staticmethod
    def _add_datum(ctx: fobs.EncodeContext) -> None:
        ctx.add_datum(fobs.Datum(b"|".join(ctx.state["blobs"]), GATHERED))

    def recompose(self, data: Any, ctx: fobs.DecodeContext) -> Blob:
        return Blob(ctx.state["blobs"][data])


def split_gathered(ctx: fobs.DecodeContext, index: int) -> None:
    ctx.state["blobs"] = bytes(ctx.frame(index)).split(b"|")
    ctx.state.setdefault("handled", []).append(index)


def test_post_callback_adds_one_datum_and_handler_runs_before_objects_are_rebuilt() -> None:
    registry = fobs.Registry()
    registry.register(GatheringBlobDecomposer())
    registry.register_datum_handler(GATHERED, split_gathered)
    decode = fobs.DecodeContext(props={"download_to_disk": False})

    header, frames = fobs.serialize([Blob(b"a"), {"b": Blob(b"bb")}], registry=registry)
    back = fobs.deserialize(header, frames, ctx=decode, registry=registry)

    assert len(frames) == 1  # one datum for the whole message, added once
    assert bytes(frames[0]) == b"a|bb"
    assert [back[0].payload, back[1]["b"].payload] == [b"a", b"bb"]
    assert decode.state["handled"] == [0]


def test_datum_handlers_are_unique_per_type() -> None:
    registry = fobs.Registry()
    registry.register_datum_handler(GATHERED, split_gathered)

    with pytest.raises(ValueError, match=r"datum type 100 already has a handler"):
        registry.register_datum_handler(GATHERED, split_gathered)
