"""What the fuzz properties share: the settings profiles, and strategies that break valid bytes.

The properties build mostly-valid inputs (a real envelope, FOBS message, safetensors header,
config file, job archive) and then break them the way a faulty or hostile peer would: bytes
flipped, cut short or spliced, lengths declared huge, fields replaced by values of the wrong
type. Purely random bytes rarely get past a decoder's first check; these reach its later ones.

Profiles (chosen with ``FLENGINE_FUZZ_PROFILE``):

- ``fuzz-ci`` (default): a few dozen examples per property, so ``pytest tests/fuzz`` takes
  seconds; no example database is written.
- ``fuzz-long``: what ``tools/fuzz.py`` runs; ``FLENGINE_FUZZ_EXAMPLES`` examples per run
  (default 1000), a looser deadline per example.
"""

from __future__ import annotations

import os
import struct
from datetime import timedelta
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

PROFILE_ENV = "FLENGINE_FUZZ_PROFILE"
EXAMPLES_ENV = "FLENGINE_FUZZ_EXAMPLES"

_SHARED: dict[str, Any] = {
    "database": None,  # nothing written into the repository, in CI or by tools/fuzz.py
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    "print_blob": True,  # a failure prints the @reproduce_failure line to keep as a regression
}
settings.register_profile("fuzz-ci", max_examples=40, deadline=timedelta(seconds=5), **_SHARED)
settings.register_profile(
    "fuzz-long",
    max_examples=int(os.environ.get(EXAMPLES_ENV, "1000")),
    deadline=timedelta(seconds=10),  # a hang or a quadratic blow-up still fails the example
    **_SHARED,
)

#: The settings every fuzz property runs with: ``@FUZZ`` above ``@given``.
FUZZ = settings(settings.get_profile(os.environ.get(PROFILE_ENV, "fuzz-ci")))


def scaled(examples: int) -> settings:
    """The profile's settings with ``examples`` as the CI example count (for a slow property).

    The long profile keeps its own count: ``tools/fuzz.py`` decides how long each property runs.
    """
    if os.environ.get(PROFILE_ENV, "fuzz-ci") != "fuzz-ci":
        return FUZZ
    return settings(FUZZ, max_examples=examples)


#: Integers a length or offset field is often broken with: zero, edges of the fixed-size types.
EDGE_INTS = st.sampled_from(
    [0, 1, -1, 7, 8, 255, 256, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**63 - 1, 2**63, 2**64 - 1]
)
_EDGE_BYTES = [0x00, 0x01, 0x7F, 0x80, 0xC1, 0xFF]


@st.composite
def mutated(draw: st.DrawFn, valid: st.SearchStrategy[bytes], max_mutations: int = 4) -> bytes:
    """A valid byte string, then up to ``max_mutations`` edits of the kinds that break decoders.

    Edits: flip one bit, set a byte to an edge value, cut the tail, delete a slice, duplicate a
    slice, insert random bytes, or overwrite 4 or 8 bytes with a huge little- or big-endian
    length. Zero edits keeps the input valid, so the happy path is fuzzed too.
    """
    data = bytearray(draw(valid))
    for _ in range(draw(st.integers(0, max_mutations))):
        size = len(data)
        edit = draw(st.sampled_from(["flip", "edge", "truncate", "delete", "duplicate", "insert", "length"]))
        at = draw(st.integers(0, max(size - 1, 0)))
        if edit == "insert" or size == 0:
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif edit == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif edit == "edge":
            data[at] = draw(st.sampled_from(_EDGE_BYTES))
        elif edit == "truncate":
            del data[at:]
        elif edit == "delete":
            del data[at : at + draw(st.integers(1, 16))]
        elif edit == "duplicate":
            piece = data[at : at + draw(st.integers(1, 32))]
            data[at:at] = piece
        else:
            width, order = draw(st.sampled_from([(4, "<I"), (8, "<Q"), (4, ">I"), (8, ">Q")]))
            limit = 2 ** (8 * width)
            value = draw(EDGE_INTS.filter(lambda n, limit=limit: 0 <= n < limit))
            data[at : at + width] = struct.pack(order, value)
    return bytes(data)


#: Any value msgpack can carry, including the awkward ones: huge ints, NaN, bytes, nesting.
MSGPACK_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | EDGE_INTS
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)

#: Any value JSON can carry, with Python's extensions (NaN, Infinity) and huge numbers.
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | EDGE_INTS | st.integers(-(10**30), 10**30) | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


def nested(depth: int, leaf: Any = 0) -> Any:
    """``leaf`` inside ``depth`` one-element lists: nesting past what a recursive decoder takes."""
    value = leaf
    for _ in range(depth):
        value = [value]
    return value
