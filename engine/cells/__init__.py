"""Cells: named ZeroMQ endpoints that exchange a msgpack envelope plus raw body frames.

The layer knows nothing of what a payload means. Public API::

    from engine.cells import Cell, CellSettings, Message, Reply, Status

    server = Cell("server", CellSettings(port=0)).start()
    site = Cell("site-1", connect_to=server.endpoint).start()
    site.register_handler("task", "get", lambda message: Reply(header={"task": "train"}))
    site.wait_connected(timeout_s=10.0)
    reply = server.request("site-1", "task", "get", timeout_s=5.0)

Errors raised are the ``Cell*Error`` classes of :mod:`engine.errors`.
"""

from __future__ import annotations

from engine.cells.cell import Cell
from engine.cells.fqcn import is_valid_fqcn
from engine.cells.handlers import Handler
from engine.cells.message import Message, Reply
from engine.cells.pending import ReplyFuture
from engine.cells.protocol import ANY_TOPIC, Status
from engine.cells.settings import CellSettings

__all__ = [
    "ANY_TOPIC",
    "Cell",
    "CellSettings",
    "Handler",
    "Message",
    "Reply",
    "ReplyFuture",
    "Status",
    "is_valid_fqcn",
]
