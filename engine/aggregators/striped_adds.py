"""`StripedAdds`: weighted adds of result chunks into the round's sums, from many threads at once.

The server folds each result's chunks in the thread that pulls it. Under one lock for the whole
sum, those threads took turns however many cores the server had; here each sum is cut into
stripes of `STRIPE_ELEMENTS` elements with a lock each, so chunks of different tensors, or of
different parts of one tensor, are added at the same time. Two results that arrive in step (chunk
k of each at once, the usual case) would queue for the same stripes; instead a block whose stripe
is busy is put aside while the next blocks are checked and added, and added when its stripe is
free, so the two take turns block by block. Each add is a plain ``sum[i:j] += w * x``, so the sum is
the same whatever the interleaving, up to the order of the additions of one element, as before.

A chunk is checked (finite) and added in one pass: a block of `BLOCK_ELEMENTS` at a time, each
checked and then added while it is still in the core's cache, so the chunk is read from memory
once. A block's stripes are held for its add only, never while it is checked. A new sum is not
zeroed whole first: each stripe is zeroed by the first add that reaches it (`settle` zeroes the
rest before the sum is read whole).

The aggregator's own lock still guards its state (which results are open, the sums themselves):
an add is *begun* under it and runs outside it; whatever replaces or reads the sums whole (the
mean, a reset, a rebuild, a whole result folded at once) first waits, under it, for the adds in
flight to end (`drain`). An add never takes the aggregator's lock: it ends under a small lock of
its own, so the threads folding chunks do not queue for the aggregator's lock twice per chunk.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator

import torch

#: Elements of a sum per stripe (one block): two results' adds wait for each other only where
#: they touch the same block of the sum.
STRIPE_ELEMENTS = 1 << 19
#: Elements checked and added at a time (2 MiB of float32, a core's L2 cache on this project's
#: VM: the add finds the block the check just read there). Python's work per block is the price:
#: with 1 MiB blocks two threads took 22% longer to fold 4 x 512 MiB (0.47 against 0.38 s), and
#: with 125 KiB blocks two fold threads spent most of their time handing the GIL to each other.
BLOCK_ELEMENTS = 1 << 19


class StripedAdds:
    """The stripe locks of the round's sums, which of their stripes are still blank, and the adds in flight.

    `begin`, `drain`, `settle` and `reset` are called with the aggregator's lock held; `add`
    without it.
    """

    def __init__(self) -> None:
        self._drained = threading.Condition(threading.Lock())  # guards the count of adds in flight
        self._adding = 0
        self._sums: dict[str, _Stripes] = {}

    def begin(self, name: str, numel: int, blank: bool = False) -> _Stripes:
        """An add into sum ``name`` (of ``numel`` elements) starts; its stripes (lock held).

        Args:
            blank: The sum was just made and never written (``torch.empty``): each stripe is
                zeroed by the first add that lands in it, in the thread that adds, so a new sum
                costs no pass of its own and no thread waits while one zeroes it whole.
        """
        stripes = self._sums.get(name)
        if stripes is None:
            stripes = self._sums[name] = _Stripes(max(1, -(-numel // STRIPE_ELEMENTS)), blank)
        with self._drained:
            self._adding += 1
        return stripes

    def add(
        self,
        stripes: _Stripes,
        flat: torch.Tensor,
        start: int,
        values: torch.Tensor,
        weight: float,
        check: Callable[[torch.Tensor], None] | None = None,
        adding: Callable[[], None] | None = None,
    ) -> None:
        """``flat[start:start + len(values)] += weight * values``, holding the stripes it touches (lock not held).

        Args:
            stripes: The sum's stripes (`begin`).
            flat: The sum, flat.
            start: Where ``values`` go in it.
            values: The chunk's values, flat.
            weight: Their weight.
            check: Refuses a block of ``values`` by raising (the workflow's finite check): called
                on each block before it is added; the blocks checked before a refused one are
                added all the same (the sum is then rebuilt without this result).
            adding: Called once, before the first block is added (the sum is changed from then on);
                raising there adds nothing.
        """
        deferred: deque[tuple[int, torch.Tensor]] = deque()  # blocks checked, their stripe busy
        try:
            with torch.no_grad():
                try:
                    for at, block in _blocks(start, values):
                        if check is not None:
                            check(block)  # outside the stripes: another result may add there meanwhile
                        if adding is not None:
                            adding()
                            adding = None
                        deferred.append((at, block))
                        # A block whose stripe is busy waits while the next ones are checked and
                        # added: two results that arrive in step (chunk k of each at once) then
                        # take turns block by block instead of queueing for every stripe.
                        for _ in range(len(deferred)):
                            item = deferred.popleft()  # out of the queue first: an error never adds it twice
                            if not stripes.add(flat, item, weight, wait=False):
                                deferred.append(item)
                finally:  # what was checked is added, also when a later block is refused
                    while deferred:
                        stripes.add(flat, deferred.popleft(), weight, wait=True)
        finally:
            with self._drained:
                self._adding -= 1
                if not self._adding:
                    self._drained.notify_all()

    def drain(self) -> None:
        """Wait until no add is in flight (the aggregator's lock held, and kept: no add begins meanwhile)."""
        with self._drained:
            self._drained.wait_for(lambda: not self._adding)

    def settle(self, name: str, flat: torch.Tensor) -> None:
        """Zero what no add reached of sum ``name`` before it is read or added to whole (lock held, after `drain`)."""
        stripes = self._sums.get(name)
        if stripes is not None:
            stripes.zero_blank(flat)

    def reset(self) -> None:
        """The sums were replaced: forget their stripes (lock held, after `drain`)."""
        self._sums = {}


class _Stripes:
    """One sum's stripe locks, and which stripes hold no value yet (each flag guarded by its stripe's lock)."""

    def __init__(self, count: int, blank: bool) -> None:
        self.locks = [threading.Lock() for _ in range(count)]
        self.blank = [blank] * count

    def add(self, flat: torch.Tensor, item: tuple[int, torch.Tensor], weight: float, wait: bool) -> bool:
        """``flat[at ..] += weight * block`` holding the block's stripes; without ``wait``, only if
        they are all free (False: nothing added). Stripes are taken in order, so two adds that
        wait never wait for each other in a circle."""
        at, block = item
        first, last = at // STRIPE_ELEMENTS, (at + block.numel() - 1) // STRIPE_ELEMENTS
        taken = first
        try:
            for index in range(first, last + 1):
                if not self.locks[index].acquire(blocking=wait):
                    return False
                taken = index + 1
            target = flat[at : at + block.numel()]
            whole_stripe = at == first * STRIPE_ELEMENTS and block.numel() == min(STRIPE_ELEMENTS, flat.numel() - at)
            if whole_stripe and self.blank[first]:  # the whole stripe at once: nothing to zero first
                if block.dtype == target.dtype:
                    torch.mul(block, weight, out=target)
                else:  # widen first, so the product is taken in the sum's dtype (as `add_` does)
                    target.copy_(block).mul_(weight)
                self.blank[first] = False
                return True
            for index in range(first, last + 1):
                if self.blank[index]:
                    flat[index * STRIPE_ELEMENTS : (index + 1) * STRIPE_ELEMENTS].zero_()
                    self.blank[index] = False
            target.add_(block, alpha=weight)
            return True
        finally:
            for index in range(taken - 1, first - 1, -1):
                self.locks[index].release()

    def zero_blank(self, flat: torch.Tensor) -> None:
        """Zero the stripes no add has reached (no add in flight)."""
        for index, blank in enumerate(self.blank):
            if blank:
                flat[index * STRIPE_ELEMENTS : (index + 1) * STRIPE_ELEMENTS].zero_()
                self.blank[index] = False


def _blocks(start: int, values: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """``values`` (bound for ``start ..`` of a sum) as ``(where, block)``, cut where the sum's
    blocks end: with stripes a multiple of blocks, each block lies in one stripe."""
    end = start + values.numel()
    at = start
    while at < end:
        stop = min(end, (at // BLOCK_ELEMENTS + 1) * BLOCK_ELEMENTS)
        yield at, values[at - start : stop - start]
        at = stop
