"""File-based decomposers: objects that travel as a file the receiver downloads.

For objects best moved as a file (a large object an application can dump and load): the sender
dumps the object into a file in a temp folder of its own and offers it through its
`DownloadService` as a raw file stream; the message carries only ``{"ref", "owner"}``. The
receiver pulls the file into a temp file, loads the object from it and deletes the file. Like
the via-downloader decomposers, both sides need a `StreamingContext` in the FOBS context's props.
"""

from __future__ import annotations

import shutil
import tempfile
from abc import abstractmethod
from pathlib import Path
from typing import Any, TypeVar

from engine.errors import FlengineError, SerializationError, StreamingError
from engine.fobs import DecodeContext, Decomposer, EncodeContext
from engine.streaming.pull import download_file
from engine.streaming.via_downloader import (
    DEFAULT_CHUNK_BYTES,
    RECEIVERS_PROP,
    STREAMING_PROP,
    StreamedItem,
    StreamingContext,
    check_owner,
)

T = TypeVar("T")

#: Name of the dumped (and of the received) file inside its own temp folder.
FILE_NAME = "object.bin"


class ViaFileDecomposer(Decomposer[T]):
    """Sends objects of one type as a file: dumped by the sender, downloaded and loaded by the receiver.

    Subclasses say which type (`supported_type`, optionally `wire_name`) and how it goes to and
    from a file (`dump_to_file`, `load_from_file`). Files are pulled in chunks of the context's
    ``tensor_chunk_bytes`` (2 MiB when that is 0). The sender's file is deleted when every
    receiver is done, when the offer times out, or when the download service closes; the
    receiver's once the object is loaded, or the download fails.

    Args:
        temp_dir: Where the temp folders of dumped and received files are made; None: the
            system's temp folder.

    Example:
        >>> class EmbeddingsFileDecomposer(ViaFileDecomposer[Embeddings]):
        ...     def supported_type(self) -> type[Embeddings]:
        ...         return Embeddings
        ...     def dump_to_file(self, obj, path):
        ...         with path.open("wb") as file:
        ...             np.save(file, obj.vectors, allow_pickle=False)
        ...     def load_from_file(self, path):
        ...         return Embeddings(np.load(path, allow_pickle=False))
        >>> registry.register(EmbeddingsFileDecomposer())   # on both sides
    """

    def __init__(self, temp_dir: Path | None = None) -> None:
        self.temp_dir = temp_dir

    @abstractmethod
    def dump_to_file(self, obj: T, path: Path) -> None:
        """Write ``obj`` into the new file ``path`` (its folder exists and is empty)."""

    @abstractmethod
    def load_from_file(self, path: Path) -> T:
        """Read the object back from ``path``; the file is deleted once this returns."""

    def decompose(self, obj: T, ctx: EncodeContext) -> Any:
        """Dump ``obj`` to a file, offer it for download, and return the reference to it.

        Raises:
            SerializationError: No streaming context with a download service, the dump failed,
                or the service is closed. Nothing is left on disk.
        """
        context = self._context(ctx.props.get(STREAMING_PROP), "sent")
        if context.service is None:
            raise SerializationError(
                f"{self._type_name()} is sent as a file, which needs a streaming context with a download "
                "service on the sending side; this side's has none"
            )
        folder = Path(tempfile.mkdtemp(prefix="flengine-send-", dir=self.temp_dir))
        path = folder / FILE_NAME
        try:
            self.dump_to_file(obj, path)
            if not path.is_file():
                raise SerializationError(f"{type(self).__name__}.dump_to_file() wrote no file at {path}")
            chunk_bytes = context.tensor_chunk_bytes or DEFAULT_CHUNK_BYTES
            receivers = ctx.props.get(RECEIVERS_PROP)
            # The service owns the folder from here on, and deletes it even when it refuses the offer.
            ref = context.service.add_file(path, chunk_bytes, receivers, context.transaction_timeout_s, folder)
        except StreamingError as e:
            shutil.rmtree(folder, ignore_errors=True)
            raise SerializationError(f"cannot offer {self._type_name()} as a file: {e}") from e
        except FlengineError:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        except Exception as e:
            shutil.rmtree(folder, ignore_errors=True)
            raise SerializationError(f"cannot dump {self._type_name()} to a file: {type(e).__name__}: {e}") from e
        return {"ref": ref, "owner": context.cell.fqcn}

    def recompose(self, data: Any, ctx: DecodeContext) -> T:
        """Download the file the reference names into a temp file, load the object, delete the file.

        Raises:
            SerializationError: No streaming context here, or a malformed reference.
            StreamingError: The download failed (names the ref and the sender).
        """
        context = self._context(ctx.props.get(STREAMING_PROP), "received")
        if not isinstance(data, dict) or not isinstance(data.get("ref"), str) or not isinstance(data.get("owner"), str):
            raise SerializationError(f"malformed reference to a file holding {self._type_name()}: {data!r}")
        check_owner(context, data["owner"], f"file holding {self._type_name()}")
        if context.peek:  # a look at the message before anything is pulled
            return StreamedItem("file")  # type: ignore[return-value]
        with tempfile.TemporaryDirectory(prefix="flengine-recv-", dir=self.temp_dir) as folder:
            path = download_file(
                context.cell,
                data["owner"],
                data["ref"],
                Path(folder) / FILE_NAME,
                context.per_request_timeout_s,
                context.max_in_flight,
                context.budget,
                context.min_throughput,
                context.retry,
                context.stop,
            )
            return self.load_from_file(path)

    def _context(self, context: StreamingContext | None, verb: str) -> StreamingContext:
        if context is None:
            raise SerializationError(
                f"{self._type_name()} is {verb} as a file, and a file-based decomposer needs a streaming context: "
                f"put a StreamingContext under props[{STREAMING_PROP!r}] of the FOBS context"
            )
        return context

    def _type_name(self) -> str:
        cls = self.supported_type()
        return f"a {cls.__module__}.{cls.__qualname__}"
