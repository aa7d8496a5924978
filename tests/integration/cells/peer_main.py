"""A cell in its own process, for the integration tests (run as a script, not collected).

Usage::

    python peer_main.py FQCN (--connect tcp://host:port | --serve PORT) [--heartbeat-interval-s S]
        [--heartbeat-timeout-s S] [--max-message-size-bytes N]

Prints ``READY <endpoint>`` once bound (server) or registered (client), then serves until its
stdin closes or it is killed. Handlers, all on channel ``test``:

- ``echo``: replies with the request's header and frames.
- ``blob``: replies with one frame of ``header["n"]`` bytes (byte i is ``i % 251``).
- ``sleep``: sleeps ``header["s"]`` seconds, then replies.
- ``raise``: raises ``ValueError("boom")``.
- ``call``: asks ``header["target"]`` on ``test``/``header["topic"]`` with ``header["inner"]``
  and the request's frames; replies with the answer's header and frames.
- ``notify`` (fire and forget): sends the header and frames back to the sender on
  ``test``/``notified``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from engine.cells import Cell, CellSettings, Message, Reply


def make_blob(size: int) -> bytearray:
    """Return ``size`` bytes where byte i is ``i % 251``."""
    pattern = bytes(range(251))
    blob = bytearray(pattern * (size // 251 + 1))
    del blob[size:]
    return blob


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("fqcn")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--connect")
    where.add_argument("--serve", type=int)
    parser.add_argument("--heartbeat-interval-s", type=float, default=0.2)
    parser.add_argument("--heartbeat-timeout-s", type=float, default=1.0)
    parser.add_argument("--max-message-size-bytes", type=int, default=1 << 30)
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format=f"[{args.fqcn} %(threadName)s] %(name)s %(message)s"
    )
    settings = CellSettings(
        port=args.serve or 0,
        heartbeat_interval_s=args.heartbeat_interval_s,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        max_message_size_bytes=args.max_message_size_bytes,
    )
    cell = Cell(args.fqcn, settings, connect_to=args.connect)

    def call(message: Message) -> Reply:
        answer = cell.request(
            message.header["target"],
            "test",
            message.header["topic"],
            header=message.header.get("inner"),
            frames=message.frames,
            timeout_s=message.header.get("timeout_s", 10.0),
        )
        return Reply(header=dict(answer.header), frames=answer.frames)

    def notify(message: Message) -> None:
        cell.send(message.source, "test", "notified", header=dict(message.header), frames=message.frames)

    def sleep(message: Message) -> Reply:
        time.sleep(message.header["s"])
        return Reply(header={"slept_s": message.header["s"]})

    def fail(message: Message) -> None:
        raise ValueError("boom")

    cell.register_handler("test", "echo", lambda m: Reply(header=dict(m.header), frames=m.frames))
    cell.register_handler("test", "blob", lambda m: Reply(frames=[make_blob(m.header["n"])]))
    cell.register_handler("test", "sleep", sleep)
    cell.register_handler("test", "raise", fail)
    cell.register_handler("test", "call", call)
    cell.register_handler("test", "notify", notify)
    cell.register_handler("test", "pid", lambda m: Reply(header={"pid": os.getpid()}))
    with cell:
        if not cell.wait_connected(30.0):
            print("NOT-CONNECTED", flush=True)
            return 1
        print(f"READY {cell.endpoint}", flush=True)
        sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
