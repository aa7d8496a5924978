"""The raw baseline of tools/bench_streaming.py: the same state dict between plain pyzmq processes.

No flengine on the wire or in the receiver: a ROUTER in the sender process answers ``info`` (the
tensors' names, shapes and dtypes as JSON) and ``chunk`` requests; chunk ``i`` is bytes
``[i * chunk_bytes, (i + 1) * chunk_bytes)`` of the tensors' bytes laid end to end, sent zero-copy
as one frame per tensor it touches. A receiver (a DEALER) keeps ``in_flight`` chunk requests out
and copies each frame (received zero-copy) into its tensors with one numpy copy, on the thread
that receives, as each reply lands. Its first transfer lands in tensors it has just allocated
with ``torch.empty`` (new memory: each page is faulted in as the copy first writes it, by the
kernel's own rules, with no advice and no populator); later transfers land in the same tensors
again (warm). With keys in the environment both sockets are CURVE (the sender checks no
allowlist), else plain TCP, so that the baseline runs under the same security as the flengine
run it is compared with. Processes speak the same line protocol as the flengine ones (READY,
CONNECTED, GO, RESULT, PEAK) and set glibc's allocator the same way.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import benchnet
import numpy as np
import torch
import zmq

#: Longest wait for one reply, in seconds.
REPLY_TIMEOUT_S = 600.0


def rss_mb(field: str = "VmRSS") -> float:
    """This process's resident set (or, with ``VmHWM``, its peak) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def usage() -> tuple[float, float]:
    """CPU seconds (user + system, all threads) and minor page faults of this process so far."""
    import resource

    now = resource.getrusage(resource.RUSAGE_SELF)
    return now.ru_utime + now.ru_stime, float(now.ru_minflt)


def chunk_plan(sizes: list[int], chunk_bytes: int) -> list[list[tuple[int, int, int]]]:
    """For each chunk, the ``(tensor index, begin, end)`` byte ranges it carries, in order.

    ``chunk_bytes`` 0 sends everything as one chunk (the inline case).
    """
    total = sum(sizes)
    step = chunk_bytes or max(total, 1)
    plan: list[list[tuple[int, int, int]]] = []
    tensor, offset = 0, 0  # the next byte: tensor index and offset in it
    for start in range(0, total, step):
        left, pieces = min(step, total - start), []
        while left:
            while sizes[tensor] == offset:
                tensor, offset = tensor + 1, 0
            count = min(left, sizes[tensor] - offset)
            pieces.append((tensor, offset, offset + count))
            offset, left = offset + count, left - count
        plan.append(pieces)
    return plan


def byte_views(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """Each contiguous CPU tensor's memory as a flat uint8 numpy array (a view)."""
    return [t.reshape(-1).view(torch.uint8).numpy() for t in tensors]


def serve(size_mb: float, chunk_bytes: int, keys: dict[str, list[str]] | None, report: Callable[[str], None]) -> None:
    """Sender process: serve BenchNet's bytes until stdin closes."""

    baseline = rss_mb()
    tensors = benchnet.state_dict(size_mb)
    model_rss = rss_mb()
    views = byte_views(list(tensors.values()))
    plan = chunk_plan([view.nbytes for view in views], chunk_bytes)
    info = json.dumps(
        {"chunk_bytes": chunk_bytes, "tensors": [[n, list(t.shape), str(t.dtype)] for n, t in tensors.items()]}
    ).encode()
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    if keys is not None:
        router.curve_publickey, router.curve_secretkey = (part.encode() for part in keys["server"])
        router.curve_server = True
    router.bind("tcp://127.0.0.1:*")
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    report(f"READY {endpoint} {baseline:.1f} {model_rss:.1f}")
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    while not stop.is_set():
        if not router.poll(100):
            continue
        routing_id, topic, *rest = router.recv_multipart()
        if topic == b"chunk":
            index = int(rest[0])
            pieces = [memoryview(views[k][begin:end]) for k, begin, end in plan[index]]
            router.send_multipart([routing_id, rest[0], *pieces], copy=False)
        elif topic == b"info":
            router.send_multipart([routing_id, info])
        else:  # ping
            router.send_multipart([routing_id, b"pong"])
    report(f"PEAK {rss_mb('VmHWM'):.1f}")
    router.close(linger=0)
    context.term()


class RawReceiver:
    """A DEALER that pulls the whole state dict into tensors, copying each frame as it lands."""

    def __init__(self, endpoint: str, site: str, keys: dict[str, list[str]] | None, in_flight: int) -> None:
        self.context = zmq.Context()
        self.dealer = self.context.socket(zmq.DEALER)
        if keys is not None:
            self.dealer.curve_publickey, self.dealer.curve_secretkey = (part.encode() for part in keys[site])
            self.dealer.curve_serverkey = keys["server"][0].encode()
        self.dealer.connect(endpoint)
        self.in_flight = in_flight

    def _reply(self) -> list[zmq.Frame]:
        if not self.dealer.poll(REPLY_TIMEOUT_S * 1000):
            raise TimeoutError("the raw sender did not answer")
        return self.dealer.recv_multipart(copy=False)

    def ping(self) -> None:
        """One round trip (after it, the connection and its CURVE handshake are up)."""
        self.dealer.send_multipart([b"ping"])
        self._reply()

    def pull(self, tensors: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Pull every chunk into ``tensors``, or into new ``torch.empty`` tensors when None."""
        self.dealer.send_multipart([b"info"])
        info = json.loads(self._reply()[0].bytes)
        if tensors is None:
            tensors = {
                name: torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")))
                for name, shape, dtype in info["tensors"]
            }
        views = byte_views(list(tensors.values()))
        plan = chunk_plan([view.nbytes for view in views], info["chunk_bytes"])
        asked = 0
        for _ in range(min(self.in_flight, len(plan))):
            self.dealer.send_multipart([b"chunk", str(asked).encode()])
            asked += 1
        for _ in range(len(plan)):
            index, *frames = self._reply()
            if asked < len(plan):  # before the copy, so the pipe stays full
                self.dealer.send_multipart([b"chunk", str(asked).encode()])
                asked += 1
            for (k, begin, end), frame in zip(plan[int(index.bytes)], frames, strict=True):
                np.copyto(views[k][begin:end], np.frombuffer(frame.buffer, dtype=np.uint8))
        return tensors

    def close(self) -> None:
        self.dealer.close(linger=0)
        self.context.term()


def receive(
    endpoint: str, site: str, size_mb: float, transfers: int, in_flight: int, keys: dict[str, list[str]] | None,
    report: Callable[[str], None],
) -> None:  # fmt: skip
    """Receiver process: the first transfer into new tensors, the later ones into the same again."""

    baseline = rss_mb()
    receiver = RawReceiver(endpoint, site, keys, in_flight)
    receiver.ping()
    report("CONNECTED")
    tensors = None
    for _ in range(transfers):
        sys.stdin.readline()  # GO
        before = usage()
        start = time.perf_counter()
        tensors = receiver.pull(tensors)
        seconds = time.perf_counter() - start
        cpu, faults = (after - was for after, was in zip(usage(), before, strict=True))
        wrong = benchnet.mismatches(tensors, size_mb)
        report(f"RESULT {seconds:.4f} {baseline:.1f} {rss_mb('VmHWM'):.1f} {len(wrong)} 0 {cpu:.4f} {faults:.0f}")
    receiver.close()


def keys_for(environment_value: str | None) -> dict[str, list[str]] | None:
    """The CURVE keys the parent handed over (Z85 text), or None for plain TCP."""
    return json.loads(environment_value) if environment_value else None
