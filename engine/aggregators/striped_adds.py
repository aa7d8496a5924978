"""`StripedAdds`: weighted adds of result chunks into the round's sums, from many threads at once.

The server folds each result's chunks in the thread that pulls it. Under one lock for the whole
sum, those threads took turns however many cores the server had; here each sum is cut into
stripes of `STRIPE_ELEMENTS` elements with a lock each, so chunks of different tensors, or of
different parts of one tensor, are added at the same time, and two chunks of the same part (two
results' chunk k) one after the other. Each add is a plain ``sum[i:j] += w * x``, so the sum is
the same whatever the interleaving, up to the order of the additions of one element, as before.

A chunk is checked (finite) and added in one pass: a block of `BLOCK_ELEMENTS` at a time, each
checked and then added while it is still in the core's cache, so the chunk is read from memory
once. A block's stripes are held for its add only, never while it is checked.

The aggregator's own lock still guards its state (which results are open, the sums themselves):
an add is *begun* under it and runs outside it; whatever replaces or reads the sums whole (the
mean, a reset, a rebuild, a whole result folded at once) first waits, under it, for the adds in
flight to end (`drain`). An add never takes the aggregator's lock: it ends under a small lock of
its own, so the threads folding chunks do not queue for the aggregator's lock twice per chunk.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

#: Elements of a sum per stripe (4 MiB of float32): a chunk of 2 MiB spans one or two.
STRIPE_ELEMENTS = 1 << 20
#: Elements checked and added at a time (1 MiB of float32, in a core's L2 cache between the check
#: and the add). Smaller blocks cost more than they save: with 125 KiB blocks, two fold threads
#: spent most of their time handing Python's GIL to each other between the many short calls.
BLOCK_ELEMENTS = 1 << 18


class StripedAdds:
    """The stripe locks of the round's sums and the adds in flight.

    `begin`, `drain` and `reset` are called with the aggregator's lock held; `add` without it.
    """

    def __init__(self) -> None:
        self._drained = threading.Condition(threading.Lock())  # guards the count of adds in flight
        self._adding = 0
        self._stripes: dict[str, list[threading.Lock]] = {}

    def begin(self, name: str, numel: int) -> list[threading.Lock]:
        """An add into sum ``name`` (of ``numel`` elements) starts; its stripe locks (lock held)."""
        stripes = self._stripes.get(name)
        if stripes is None:
            count = max(1, -(-numel // STRIPE_ELEMENTS))
            stripes = self._stripes[name] = [threading.Lock() for _ in range(count)]
        with self._drained:
            self._adding += 1
        return stripes

    def add(
        self,
        stripes: list[threading.Lock],
        flat: torch.Tensor,
        start: int,
        values: torch.Tensor,
        weight: float,
        check: Callable[[torch.Tensor], None] | None = None,
        adding: Callable[[], None] | None = None,
        before: Callable[[], None] | None = None,
    ) -> None:
        """``flat[start:start + len(values)] += weight * values``, holding the stripes it touches (lock not held).

        Args:
            stripes: The sum's stripe locks (`begin`).
            flat: The sum, flat.
            start: Where ``values`` go in it.
            values: The chunk's values, flat.
            weight: Their weight.
            check: Refuses a block of ``values`` by raising (the workflow's finite check): called
                on each block just before it is added, so what was added before it stays added.
            adding: Called once, before the first block is added (the sum is changed from then on).
            before: Called first, while the add counts as in flight (a new sum is zeroed here,
                outside the aggregator's lock; or this add waits until it is).
        """
        try:
            if before is not None:
                before()
            with torch.no_grad():
                for offset in range(0, values.numel(), BLOCK_ELEMENTS):
                    block = values[offset : offset + BLOCK_ELEMENTS]
                    if check is not None:
                        check(block)  # outside the stripes: another result may add there meanwhile
                    if adding is not None:
                        adding()
                        adding = None
                    at = start + offset
                    first, last = at // STRIPE_ELEMENTS, (at + block.numel() - 1) // STRIPE_ELEMENTS
                    held = stripes[first : last + 1]  # in order: two adds never wait for each other in a circle
                    for stripe in held:
                        stripe.acquire()
                    try:
                        flat[at : at + block.numel()].add_(block, alpha=weight)
                    finally:
                        for stripe in reversed(held):
                            stripe.release()
        finally:
            with self._drained:
                self._adding -= 1
                if not self._adding:
                    self._drained.notify_all()

    def drain(self) -> None:
        """Wait until no add is in flight (the aggregator's lock held, and kept: no add begins meanwhile)."""
        with self._drained:
            self._drained.wait_for(lambda: not self._adding)

    def reset(self) -> None:
        """The sums were replaced: forget their stripes (lock held, after `drain`)."""
        self._stripes = {}
