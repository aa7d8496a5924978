"""A process on the other end of a download, for the streaming integration tests.

    streaming_peer.py serve  RECEIVERS      # server cell offering seeded tensors; prints READY <endpoint> <ref>
    streaming_peer.py fetch  ENDPOINT       # client cell site-1: prints CONNECTED, reads a ref from stdin,
                                            # pulls it slowly: prints STARTED, then DONE

Both run until their stdin closes (serve) or the download ends (fetch).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

from engine.cells import Cell, CellSettings  # noqa: E402
from engine.streaming.consumers import MemoryConsumer  # noqa: E402
from engine.streaming.pull import download_tensors  # noqa: E402
from engine.streaming.service import DownloadService  # noqa: E402

HEARTBEAT = {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 1.0}
CHUNK_BYTES = 256 * 1024


def seeded_tensors(layers: int = 8) -> dict[str, torch.Tensor]:
    """The same tensors in every process: 8 layers of 256x256 float32 plus biases (about 2 MiB)."""
    generator = torch.Generator().manual_seed(7)
    tensors = {}
    for i in range(layers):
        tensors[f"layers.{i}.weight"] = torch.rand(256, 256, generator=generator)
        tensors[f"layers.{i}.bias"] = torch.rand(256, generator=generator)
    return tensors


def serve(receivers: list[str]) -> None:
    cell = Cell("server", CellSettings(port=0, **HEARTBEAT)).start()
    service = DownloadService(cell, sweep_interval_s=0.2)
    ref = service.add_tensors(seeded_tensors(), CHUNK_BYTES, receivers=receivers, timeout_s=60)
    print(f"READY {cell.endpoint} {ref}", flush=True)
    sys.stdin.read()
    service.close()
    cell.stop()


class SlowConsumer(MemoryConsumer):
    """Takes a chunk every 0.2 s and says when the first one is in."""

    places_on_io_thread = False  # it sleeps: keep it off the cell's I/O thread

    def accept(self, index, frames) -> None:  # type: ignore[no-untyped-def]
        super().accept(index, frames)
        if len(self._received) == 1:
            print("STARTED", flush=True)
        time.sleep(0.2)


def fetch(endpoint: str) -> None:
    cell = Cell("site-1", CellSettings(**HEARTBEAT), connect_to=endpoint).start()
    cell.wait_connected(timeout_s=10)
    print("CONNECTED", flush=True)
    ref = sys.stdin.readline().strip()
    download_tensors(cell, "server", ref, per_request_timeout_s=10, consumer_factory=SlowConsumer, max_in_flight=1)
    print("DONE", flush=True)
    cell.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    sub.add_parser("serve").add_argument("receivers", nargs="+")
    sub.add_parser("fetch").add_argument("endpoint")
    args = parser.parse_args()
    serve(args.receivers) if args.mode == "serve" else fetch(args.endpoint)
