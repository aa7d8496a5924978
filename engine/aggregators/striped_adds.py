"""`StripedAdds`: weighted adds of result chunks into the round's sums, from many threads at once.

The server folds each result's chunks in the thread that pulls it. Under one lock for the whole
sum, those threads took turns however many cores the server had; here each sum is cut into
stripes of `STRIPE_ELEMENTS` elements with a lock each, so chunks of different tensors, or of
different parts of one tensor, are added at the same time, and two chunks of the same part (two
results' chunk k) one after the other. Each add is a plain ``sum[i:j] += w * x``, so the sum is
the same whatever the interleaving, up to the order of the additions of one element, as before.

The aggregator's own lock still guards its state (which results are open, the sums themselves):
an add is *begun* under it and runs outside it; whatever replaces or reads the sums whole (the
mean, a reset, a rebuild, a whole result folded at once) first waits, under it, for the adds in
flight to end (`drain`).
"""

from __future__ import annotations

import threading

import torch

#: Elements of a sum per stripe (4 MiB of float32): a chunk of 2 MiB spans one or two.
STRIPE_ELEMENTS = 1 << 20


class StripedAdds:
    """The stripe locks of the round's sums and the adds in flight.

    Args:
        lock: The aggregator's lock, which guards `begin`, `drain` and `reset` (they are called
            with it held).
    """

    def __init__(self, lock: threading.Lock) -> None:
        self._drained = threading.Condition(lock)
        self._adding = 0
        self._stripes: dict[str, list[threading.Lock]] = {}

    def begin(self, name: str, numel: int) -> list[threading.Lock]:
        """An add into sum ``name`` (of ``numel`` elements) starts; its stripe locks (lock held)."""
        stripes = self._stripes.get(name)
        if stripes is None:
            count = max(1, -(-numel // STRIPE_ELEMENTS))
            stripes = self._stripes[name] = [threading.Lock() for _ in range(count)]
        self._adding += 1
        return stripes

    def add(
        self, stripes: list[threading.Lock], flat: torch.Tensor, start: int, values: torch.Tensor, weight: float
    ) -> None:
        """``flat[start:start + len(values)] += weight * values``, holding the stripes it touches (lock not held)."""
        try:
            first, last = start // STRIPE_ELEMENTS, (start + max(values.numel(), 1) - 1) // STRIPE_ELEMENTS
            held = stripes[first : last + 1]  # taken in order: two adds never wait for each other in a circle
            for stripe in held:
                stripe.acquire()
            try:
                with torch.no_grad():
                    flat[start : start + values.numel()].add_(values, alpha=weight)
            finally:
                for stripe in reversed(held):
                    stripe.release()
        finally:
            with self._drained:
                self._adding -= 1
                if not self._adding:
                    self._drained.notify_all()

    def drain(self) -> None:
        """Wait until no add is in flight (lock held; it is released while waiting)."""
        self._drained.wait_for(lambda: not self._adding)

    def reset(self) -> None:
        """The sums were replaced: forget their stripes (lock held, after `drain`)."""
        self._stripes = {}
