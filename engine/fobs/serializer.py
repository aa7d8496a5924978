"""`serialize` and `deserialize`: objects to a msgpack header plus raw frames, and back.

Wire layout of one message: frame 0 is the header, a msgpack map
``{"fobs": 1, "dots": [datum type per frame], "body": <msgpack bytes>}``; frames 1..n are the
datums, each sent and received as-is. In the body, a decomposed object is a msgpack extension
holding ``[wire name, data]`` and a datum is an extension holding its frame index. The body is
packed apart from the header so datum handlers (a downloader) run before any object is rebuilt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from engine.errors import FlengineError, MalformedMessageError, SerializationError
from engine.fobs.context import DecodeContext, EncodeContext
from engine.fobs.datum import DATUM_THRESHOLD_BYTES, Buffer, Datum, DatumType
from engine.fobs.registry import Registry

FORMAT_VERSION = 1
#: A header (everything but the datum frames) larger than this is refused unread.
MAX_HEADER_BYTES = 256 * 1024 * 1024
#: Decomposed objects nested deeper than this are refused (msgpack bounds plain nesting itself).
MAX_OBJECT_DEPTH = 64

_EXT_OBJECT = 1
_EXT_DATUM = 2
_SCALARS = (str, int, float, bool, type(None))
_BUFFERS = (bytes, bytearray, memoryview)


def serialize(obj: Any, registry: Registry, ctx: EncodeContext | None = None) -> tuple[bytes, list[memoryview]]:
    """Turn ``obj`` into a header and datum frames; no big buffer is copied.

    Args:
        obj: Plain data (dict, list, str, int, float, bool, None, bytes) and registered types.
        registry: Decomposers to use.
        ctx: Per-message state, e.g. with the sending side's ``props``; a fresh one by default.

    Returns:
        The header bytes and the datum frames, to be sent in that order. The frames point into
        the objects' own memory, which must not change until the message is sent.

    Raises:
        UnknownTypeError: Some object's type has no decomposer.
        SerializationError: Anything else that cannot be encoded.
    """
    ctx = ctx if ctx is not None else EncodeContext()
    try:
        body = _Encoder(registry, ctx).encode(obj)
        ctx.run_post_callbacks()
        body_bytes = msgpack.packb(body)
    except RecursionError as e:
        raise SerializationError("the object is nested too deeply to serialize") from e
    except (TypeError, ValueError, OverflowError) as e:
        raise SerializationError(f"cannot serialize: {e}") from e
    header = msgpack.packb({"fobs": FORMAT_VERSION, "dots": [int(d.dot) for d in ctx.datums], "body": body_bytes})
    return header, [memoryview(d.data) for d in ctx.datums]


def deserialize(
    header: Buffer,
    frames: Sequence[Any],
    registry: Registry,
    ctx: DecodeContext | None = None,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> Any:
    """Rebuild the object of a message received from a peer (untrusted input).

    Args:
        header: Frame 0 of the message.
        frames: The datum frames (any buffers: bytes, memoryviews, zmq frames' buffers).
        registry: Decomposers and datum handlers to use; only types registered here are rebuilt.
        ctx: Per-message state, e.g. with the receiving side's ``props``; a fresh one by default.
        max_header_bytes: Larger headers are refused before they are parsed.

    Raises:
        MalformedMessageError: The bytes are not a well-formed message.
        UnknownTypeError: The message names a type not registered here.
        SerializationError: A decomposer could not rebuild its object.
    """
    size = memoryview(header).nbytes
    if size > max_header_bytes:
        raise MalformedMessageError(f"message header of {size} bytes exceeds the limit of {max_header_bytes} bytes")
    ctx = ctx if ctx is not None else DecodeContext()
    top = _unpack(header, ext_hook=None)
    if not isinstance(top, dict) or top.get("fobs") != FORMAT_VERSION:
        raise MalformedMessageError(f"not a FOBS message of format {FORMAT_VERSION}")
    dots, body = top.get("dots"), top.get("body")
    if not isinstance(dots, list) or not all(type(d) is int for d in dots) or not isinstance(body, bytes):
        raise MalformedMessageError("FOBS header lacks a valid datum list or body")
    if len(dots) != len(frames):
        raise MalformedMessageError(f"header lists {len(dots)} datums but {len(frames)} frames arrived")
    ctx.frames, ctx.dots = frames, dots
    try:
        for index, dot in enumerate(dots):
            handler = registry.datum_handler(dot)
            if handler is not None:
                handler(ctx, index)
        return _unpack(body, ext_hook=_Decoder(registry, ctx).ext_hook)
    finally:
        ctx.frames = ()  # a context the caller keeps must not keep the received buffers alive


def _unpack(data: Buffer, ext_hook: Any) -> Any:
    limit = max(memoryview(data).nbytes, 1)
    options: dict[str, Any] = {"ext_hook": ext_hook} if ext_hook is not None else {}
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=False,
            max_str_len=limit,
            max_bin_len=limit,
            max_array_len=limit,
            max_map_len=limit,
            max_ext_len=limit,
            **options,
        )
    except FlengineError:
        raise
    except (ValueError, TypeError, UnicodeDecodeError, msgpack.UnpackException) as e:
        raise MalformedMessageError(f"malformed FOBS message: {type(e).__name__}: {e or 'bad msgpack data'}") from e


class _Encoder:
    def __init__(self, registry: Registry, ctx: EncodeContext) -> None:
        self.registry = registry
        self.ctx = ctx

    def encode(self, value: Any) -> Any:
        kind = type(value)
        if kind in _SCALARS:
            return value
        if kind is dict:
            return {self._key(k): self.encode(v) for k, v in value.items()}
        if kind is list:
            return [self.encode(v) for v in value]
        if kind in _BUFFERS:
            if memoryview(value).nbytes >= DATUM_THRESHOLD_BYTES:
                return self._datum(Datum(value))
            return value if kind is bytes else bytes(value)
        if kind is Datum:
            return self._datum(value)
        decomposer = self.registry.for_type(kind)
        data = self.encode(decomposer.decompose(value, self.ctx))
        return msgpack.ExtType(_EXT_OBJECT, msgpack.packb([self.registry.wire_name(decomposer), data]))

    def _datum(self, datum: Datum) -> msgpack.ExtType:
        return msgpack.ExtType(_EXT_DATUM, msgpack.packb(self.ctx.add_datum(datum)))

    @staticmethod
    def _key(key: Any) -> Any:
        kind = type(key)
        if kind is str or kind is int:
            return key
        # A str or int subclass (a str-valued Enum, say) goes as its plain value, which compares
        # and hashes equal to it, so lookups with the original key still find the entry.
        if isinstance(key, str):
            return "" + key
        if isinstance(key, int) and not isinstance(key, bool):
            return int(key)
        raise SerializationError(f"dict keys must be str or int, got {kind.__name__} key {key!r}")


class _Decoder:
    def __init__(self, registry: Registry, ctx: DecodeContext) -> None:
        self.registry = registry
        self.ctx = ctx

    def ext_hook(self, code: int, data: bytes) -> Any:
        if code == _EXT_DATUM:
            index = _unpack(data, ext_hook=None)
            frame = self.ctx.frame(index)
            return bytes(frame) if self.ctx.dots[index] == DatumType.BYTES else frame
        if code != _EXT_OBJECT:
            raise MalformedMessageError(f"unknown msgpack extension type {code}")
        if self.ctx.depth >= MAX_OBJECT_DEPTH:
            raise MalformedMessageError(f"objects nested deeper than {MAX_OBJECT_DEPTH} levels")
        self.ctx.depth += 1
        try:
            item = _unpack(data, ext_hook=self.ext_hook)
        finally:
            self.ctx.depth -= 1
        if not isinstance(item, list) or len(item) != 2:
            raise MalformedMessageError("a decomposed object must be [type name, data]")
        name, payload = item
        decomposer = self.registry.for_name(name)
        try:
            return decomposer.recompose(payload, self.ctx)
        except FlengineError:
            raise
        except Exception as e:
            raise SerializationError(f"cannot rebuild an object of type {name!r}: {type(e).__name__}: {e}") from e
