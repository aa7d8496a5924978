"""`SiteEndpoint`: one process's network side, the one place where cells are assembled.

A site (``server``, ``site-1``) has settings that belong to it, not to a job: its name, its
keys, its address and limits (:class:`SiteSettings`). A job brings its streaming settings
(chunk sizes, per-request timeout). The endpoint joins the two and owns the
:class:`~engine.cells.Cell`, its :class:`~engine.streaming.service.DownloadService`, the
:class:`~engine.streaming.codec.MessageCodec`, and the receive policy (tensors land in memory,
or on disk first inside :meth:`SiteEndpoint.downloads_to_disk`). The server job, the client
job, the Client API executor and its training-script backend each take one; none builds a cell
itself, so CURVE, the allowlist and every limit apply everywhere the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import zmq

from engine.cells import Cell, CellSettings
from engine.cells.security import Allowlist, CellSecurity
from engine.errors import SecurityError
from engine.fobs import default_registry
from engine.paths import path_inside_any
from engine.security import SERVER_KEY_FILE, load_cell_security
from engine.site.insecure import INSECURE_KEY
from engine.streaming.codec import MessageCodec
from engine.streaming.disk import DiskConsumerFactory, DiskDownloads
from engine.streaming.service import DownloadService
from engine.streaming.via_downloader import StreamingContext, retry_policy_of

log = logging.getLogger(__name__)

#: Where downloads to disk go by default, under a side's workspace folder.
DEFAULT_DOWNLOADS_FOLDER = "downloads"


def cell_settings_of(config: Mapping[str, Any]) -> CellSettings:
    """The `CellSettings` of a validated config's ``cell`` object (``insecure`` is the site's, not the cell's)."""
    cell = {key: value for key, value in config.get("cell", {}).items() if key != INSECURE_KEY}
    return CellSettings.from_config(cell)


@dataclasses.dataclass(frozen=True)
class SiteSettings:
    """What belongs to a site: its name, cell settings, keys and the folders jobs may use.

    Attributes:
        name: The site's identity (``server``, ``site-1``); its cells are this name or a child
            of it (``site-1.job``).
        cell: Address, liveness and size limits of its cells.
        keys_dir: Its keys folder (see :mod:`engine.security.keys`); required unless insecure.
        insecure: True turns CURVE off; only ever explicit, and warned about at every start.
        allowed_dirs: Absolute folders outside its workspace that a job's paths may name
            (``download_to_disk_dir``, ``source_ckpt_file_full_name``); none by default, so a
            job stays in its workspace and its job folder. The site decides, never a job
            (``flengine run --allow-dir DIR``).
        key_name: Whose key pair in ``keys_dir`` the site's cells use, when not its own: a
            virtual client of a simulation uses its worker's (``worker-1``), which the server's
            allowlist lets speak for it (`engine.cells.security.Allowlist.delegate`).
    """

    name: str
    cell: CellSettings = dataclasses.field(default_factory=CellSettings)
    keys_dir: Path | None = None
    insecure: bool = False
    allowed_dirs: tuple[Path, ...] = ()
    key_name: str | None = None

    def __post_init__(self) -> None:
        if self.keys_dir is None and not self.insecure:
            raise SecurityError(
                f"site {self.name!r}: no keys folder; give the site its keys (keys_dir), or set "
                "insecure = true to run without encryption"
            )
        allowed = tuple(Path(folder) for folder in self.allowed_dirs)
        for folder in allowed:
            if not folder.is_absolute():
                raise SecurityError(
                    f"site {self.name!r}: allowed_dirs: {str(folder)!r} is relative; give absolute folders"
                )
        object.__setattr__(self, "allowed_dirs", allowed)

    def cell_security(self, server: bool) -> CellSecurity | None:
        """Load the site's CURVE keys for a server or a client cell (None when insecure)."""
        if self.insecure:
            return None
        assert self.keys_dir is not None
        return load_cell_security(self.keys_dir, self.key_name or self.name, server)

    def describe_refusal(self, link_error: str) -> str:
        """Say what a refused connection to the server means for this site, naming its files."""
        own = self.keys_dir / f"{self.key_name or self.name}.key" if self.keys_dir else "its key"
        server_key = self.keys_dir / SERVER_KEY_FILE if self.keys_dir else "the server's key"
        return (
            f"{self.name}: the server did not let this site in: {link_error}; check that {server_key} is the "
            f"server's public key and that the server's allowlist holds {own}"
        )


#: The name a training script's cell takes under its site (``site-1.script``).
SCRIPT_CELL_SUFFIX = "script"
_ENV_SCRIPT_PUBLIC = "FLENGINE_SCRIPT_PUBLIC_KEY"
_ENV_SCRIPT_SECRET = "FLENGINE_SCRIPT_SECRET_KEY"
_ENV_EXECUTOR_PUBLIC = "FLENGINE_EXECUTOR_PUBLIC_KEY"


@dataclasses.dataclass(frozen=True)
class ScriptCredentials:
    """The throw-away keys a training script uses to reach its executor's local cell (Z85).

    Made afresh for every script process and passed in its environment, which only that
    process (and its own user) can read: no key file is written.
    """

    public_key: bytes
    secret_key: bytes
    executor_public_key: bytes

    def to_environment(self) -> dict[str, str]:
        """The environment variables that carry the credentials to the script."""
        return {
            _ENV_SCRIPT_PUBLIC: self.public_key.decode("ascii"),
            _ENV_SCRIPT_SECRET: self.secret_key.decode("ascii"),
            _ENV_EXECUTOR_PUBLIC: self.executor_public_key.decode("ascii"),
        }

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> ScriptCredentials | None:
        """The credentials in ``environ``; None when the executor runs insecure (none given)."""
        values = [environ.get(name) for name in (_ENV_SCRIPT_PUBLIC, _ENV_SCRIPT_SECRET, _ENV_EXECUTOR_PUBLIC)]
        if not any(values):
            return None
        if not all(values):
            raise SecurityError(
                "the training script has only part of its keys in its environment; run it through flengine"
            )
        public, secret, executor = (value.encode("ascii") for value in values if value is not None)
        return cls(public, secret, executor)

    def cell_security(self) -> CellSecurity:
        """The script cell's CURVE settings (a client of the executor's cell)."""
        return CellSecurity(self.public_key, self.secret_key, server_public_key=self.executor_public_key)


class SiteEndpoint:
    """The cell, download service, codec and receive policy of one process.

    Args:
        cell_name: The cell's name: the site's name or one of its children.
        settings: The site's cell settings.
        security: CURVE keys for the cell, or None (insecure).
        streaming: The job's streaming settings (``tensor_download_chunk_size`` ...).
        connect_to: The server's endpoint for a client; None for the server cell.
        workspace: Where downloads to disk go by default (``<workspace>/downloads``).
        allowed_dirs: Folders outside ``workspace`` that downloads to disk may go to (the
            site's `SiteSettings.allowed_dirs`).

    Example:
        >>> endpoint = SiteEndpoint.for_site(site, streaming, connect_to=address, workspace=folder)
        >>> endpoint.start()
        >>> frames = endpoint.codec.encode(model, receivers=["server"])
    """

    def __init__(
        self,
        cell_name: str,
        settings: CellSettings,
        security: CellSecurity | None,
        streaming: Mapping[str, Any],
        *,
        connect_to: str | None = None,
        workspace: Path | None = None,
        allowed_dirs: Sequence[Path] = (),
    ) -> None:
        self.cell = Cell(cell_name, settings, connect_to=connect_to, security=security)
        self.streaming = dict(streaming)
        self.workspace = workspace if workspace is not None else Path.cwd()
        self.allowed_dirs = tuple(allowed_dirs)
        self.service: DownloadService | None = None
        self._codec: MessageCodec | None = None

    @classmethod
    def for_site(
        cls,
        site: SiteSettings,
        streaming: Mapping[str, Any],
        *,
        connect_to: str | None = None,
        workspace: Path | None = None,
        cell_name: str | None = None,
    ) -> SiteEndpoint:
        """The endpoint of ``site``'s cell (the site's own name unless ``cell_name`` gives a child).

        Raises:
            SecurityError: The site's keys are missing, malformed or unsafe (file named).
        """
        security = site.cell_security(server=connect_to is None)
        return cls(
            cell_name or site.name,
            site.cell,
            security,
            streaming,
            connect_to=connect_to,
            workspace=workspace,
            allowed_dirs=site.allowed_dirs,
        )

    @classmethod
    def for_script_host(
        cls, site_name: str, streaming: Mapping[str, Any], *, secure: bool, workspace: Path | None = None
    ) -> tuple[SiteEndpoint, ScriptCredentials | None]:
        """The local cell an executor opens for its training script, and the script's credentials.

        The cell is named after the site, binds 127.0.0.1 on a free port, and (``secure``)
        accepts exactly one key: the script's, as ``<site>.script``. Both key pairs are new.
        """
        security, credentials = None, None
        if secure:
            public, secret = zmq.curve_keypair()
            script_public, script_secret = zmq.curve_keypair()
            allowlist = Allowlist({f"{site_name}.{SCRIPT_CELL_SUFFIX}": script_public})
            security = CellSecurity(public, secret, allowlist=allowlist)
            credentials = ScriptCredentials(script_public, script_secret, public)
        settings = CellSettings(host="127.0.0.1", port=0)
        return cls(site_name, settings, security, streaming, workspace=workspace), credentials

    @classmethod
    def for_script(
        cls, site_name: str, connect_to: str, credentials: ScriptCredentials | None, streaming: Mapping[str, Any]
    ) -> SiteEndpoint:
        """The endpoint of a training script: cell ``<site>.script``, a client of its executor's cell."""
        security = None if credentials is None else credentials.cell_security()
        name = f"{site_name}.{SCRIPT_CELL_SUFFIX}"
        return cls(name, CellSettings(), security, streaming, connect_to=connect_to)

    @property
    def codec(self) -> MessageCodec:
        """The message codec (after :meth:`start`)."""
        if self._codec is None:
            raise RuntimeError(f"endpoint {self.cell.fqcn!r} is not started")
        return self._codec

    @property
    def receives_to_disk(self) -> bool:
        """True inside :meth:`downloads_to_disk`: received tensors go to disk first."""
        return self._codec is not None and isinstance(self._codec.context.consumer_factory, DiskConsumerFactory)

    def start(self) -> SiteEndpoint:
        """Open the cell and start serving downloads; a client returns before it is connected."""
        self.cell.start()
        self.service = DownloadService(self.cell, retries=retry_policy_of(self.streaming).retries)
        self._codec = MessageCodec(
            default_registry(), StreamingContext.from_config(self.cell, self.service, self.streaming)
        )
        return self

    @property
    def chunks_served(self) -> int:
        """Chunks the download service has served so far."""
        return 0 if self.service is None else self.service.chunks_served

    @contextlib.contextmanager
    def downloads_to_disk(self, folder: Path | None = None) -> Iterator[DiskDownloads]:
        """Inside the block, the tensors this endpoint receives go to disk first (lazy refs).

        Args:
            folder: Where the downloads go (a job's ``download_to_disk_dir``; relative paths
                from the workspace); ``downloads`` under the workspace if None. The block's
                own folder is removed at its end.

        Raises:
            PathOutsideError: ``folder`` (symlinks resolved) lies neither in the workspace nor in
                one of the site's allowed folders; nothing was made.
        """
        downloads = DiskDownloads(self.download_folder(folder))
        downloads.open()
        codec = self.codec
        previous = codec.context
        codec.context = dataclasses.replace(previous, consumer_factory=downloads.consumer_factory())
        try:
            yield downloads
        finally:
            codec.context = previous
            downloads.close()

    def download_folder(self, folder: Path | str | None = None) -> Path:
        """Where :meth:`downloads_to_disk` puts the downloads for ``folder``, checked (symlinks resolved).

        Raises:
            PathOutsideError: ``folder`` lies neither in the workspace nor in an allowed folder.
        """
        return path_inside_any(
            [self.workspace, *self.allowed_dirs],
            folder or DEFAULT_DOWNLOADS_FOLDER,
            "download_to_disk_dir",
            "the site's workspace and the folders the site allows",
        )

    def close(self) -> None:
        """Stop serving downloads and stop the cell (safe to call twice, or before start)."""
        if self.service is not None:
            self.service.close()
        self.cell.stop()
