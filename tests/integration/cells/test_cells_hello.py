"""A client started before its server does not pile up hellos for it."""

from __future__ import annotations

import time

import zmq

from engine.cells import Cell, CellSettings
from engine.cells.envelope import decode_envelope
from engine.cells.protocol import Kind

INTERVAL_S = 0.05


def test_hellos_do_not_queue_while_the_server_is_not_there(free_port: int) -> None:
    settings = CellSettings(heartbeat_interval_s=INTERVAL_S, heartbeat_timeout_s=10 * INTERVAL_S)
    endpoint = f"tcp://127.0.0.1:{free_port}"
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    try:
        with Cell("site-1", settings, connect_to=endpoint):
            time.sleep(40 * INTERVAL_S)  # forty heartbeat intervals without a server
            router.bind(endpoint)  # a server that never answers: hellos keep coming, one per interval
            assert router.poll(10_000), "no hello arrived once the server was there"
            arrived = time.monotonic()
            hellos = 0
            while router.poll(0) or time.monotonic() - arrived < 0.5 * INTERVAL_S:
                if router.poll(10):
                    _, envelope, *_ = router.recv_multipart()
                    hellos += decode_envelope(envelope).kind is Kind.HELLO
    finally:
        router.close(linger=0)
        context.term()

    assert 1 <= hellos <= 3  # the hello of the handshake, not forty queued ones
