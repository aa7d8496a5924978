"""Handlers registered with ``inline=True`` run on the cell's I/O thread and keep its guarantees."""

from __future__ import annotations

import threading

import pytest

from engine.cells import Message, Reply
from engine.errors import CellRemoteError

from .harness import Harness


def test_inline_handler_runs_on_the_io_thread_and_replies(harness: Harness) -> None:
    server = harness.cell("server")
    client = harness.cell("site-1", connect_to=server.endpoint)
    seen: list[str] = []

    def where(message: Message) -> Reply:
        seen.append(threading.current_thread().name)
        return Reply(header={"echo": message.header["n"]}, frames=[b"x" * 1000])

    server.register_handler("t", "inline", where, inline=True)
    server.register_handler("t", "pooled", where)

    inline = client.request("server", "t", "inline", {"n": 1}, timeout_s=10)
    pooled = client.request("server", "t", "pooled", {"n": 2}, timeout_s=10)

    assert (inline.header["echo"], pooled.header["echo"]) == (1, 2)
    assert bytes(inline.frames[0]) == b"x" * 1000
    assert seen[0] == "server-io"
    assert seen[1] != "server-io"


def test_a_raising_inline_handler_gets_an_error_reply_and_the_cell_keeps_serving(harness: Harness) -> None:
    server = harness.cell("server")
    client = harness.cell("site-1", connect_to=server.endpoint)
    server.register_handler("t", "boom", lambda message: 1 / 0, inline=True)
    server.register_handler("t", "ok", lambda message: Reply(header={"fine": True}), inline=True)

    with pytest.raises(CellRemoteError, match=r"handler for channel='t' topic='boom' raised ZeroDivisionError"):
        client.request("server", "t", "boom", timeout_s=10)

    assert client.request("server", "t", "ok", timeout_s=10).header == {"fine": True}


def test_an_inline_predicate_chooses_the_thread_per_message(harness: Harness) -> None:
    server = harness.cell("server")
    client = harness.cell("site-1", connect_to=server.endpoint)
    seen: dict[str, str] = {}

    def where(message: Message) -> Reply:
        seen[message.header["case"]] = threading.current_thread().name
        return Reply(header={"case": message.header["case"]})

    def quick(message: Message) -> bool:
        if message.header["case"] == "broken":
            raise RuntimeError("predicate failed")
        return message.header["case"] == "quick"

    server.register_handler("t", "maybe", where, inline=quick)

    for case in ("quick", "slow", "broken"):
        assert client.request("server", "t", "maybe", {"case": case}, timeout_s=10).header == {"case": case}

    assert seen["quick"] == "server-io"
    assert seen["slow"].startswith("server-handler-")
    assert seen["broken"].startswith("server-handler-")  # a predicate that raises falls back to the pool
