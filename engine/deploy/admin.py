"""`AdminSession`: an admin's connection to the server daemon, one command at a time.

The session's cell is a child of the admin's identity (``alice.3f9a1c2e``), so an admin may run
several commands at once (two terminals, a script); it authenticates with the kit's key pair and
trusts only the server key of the kit. Every answer is JSON data, or an `AdminError` with the
server's reason.
"""

from __future__ import annotations

import concurrent.futures
import json
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any

from engine.cells import Status
from engine.config import validate_job
from engine.deploy import protocol
from engine.deploy.archive import archive_digest, pack_job, unpack_job
from engine.deploy.transfer import pull_archive
from engine.errors import CellError, ConfigError, FlengineError, SecurityError, UsageError
from engine.provision import Kit
from engine.site import SiteEndpoint, SiteSettings
from engine.text import printable

#: Seconds an admin session waits for the server to accept its connection.
CONNECT_TIMEOUT_S = 10.0
#: Seconds a command may take (a submit downloads the job; an abort waits for the job to stop).
COMMAND_TIMEOUT_S = 120.0


class AdminError(FlengineError):
    """The server refused or failed a command; the message is the server's reason."""


class AdminSession:
    """A connected admin session; use as a context manager.

    Args:
        kit: The admin's startup kit (already verified by `engine.provision.load_kit`).

    Example:
        >>> with AdminSession(load_kit("kits/alice")) as admin:
        ...     job = admin.submit(Path("jobs/fedavg"))
        ...     print(admin.command("status", job_id=job["job_id"])["status"])
    """

    def __init__(self, kit: Kit) -> None:
        if kit.participant.kind != "admin":
            raise UsageError(
                f"{kit.folder}: the kit of {kit.identity!r} is a {kit.participant.kind} kit, not an admin's"
            )
        self.kit = kit
        self._endpoint: SiteEndpoint | None = None

    def __enter__(self) -> AdminSession:
        settings = SiteSettings(self.kit.identity, self.kit.cell_settings(), self.kit.keys_dir)
        cell_name = f"{self.kit.identity}.{secrets.token_hex(4)}"
        endpoint = SiteEndpoint.for_site(
            settings, {}, connect_to=self.kit.server.connect_address, cell_name=cell_name, workspace=Path.cwd()
        )
        self._endpoint = endpoint.start()
        if not endpoint.cell.wait_connected(CONNECT_TIMEOUT_S):
            error = endpoint.cell.link_error
            self.close()
            if error is not None:
                raise SecurityError(settings.describe_refusal(error))
            raise AdminError(
                f"the server at {self.kit.server.connect_address} did not answer within {CONNECT_TIMEOUT_S:g} s; "
                "is it running, and does this kit belong to it?"
            )
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the session's cell (safe to call twice)."""
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None

    @property
    def endpoint(self) -> SiteEndpoint:
        """The session's endpoint (inside the ``with`` block)."""
        if self._endpoint is None:
            raise RuntimeError("the admin session is not open")
        return self._endpoint

    def command(self, name: str, timeout_s: float = COMMAND_TIMEOUT_S, **args: Any) -> Any:
        """Run one command on the server; return its JSON answer.

        Raises:
            AdminError: The server refused or failed it (its reason), or did not answer.
        """
        try:
            future = self.endpoint.cell.request_async(
                self.kit.server.name,
                protocol.ADMIN_CHANNEL,
                protocol.TOPIC_COMMAND,
                {"command": name, **args},
                timeout_s=timeout_s,
            )
            reply = future.result(timeout=timeout_s + 5.0)  # the cell fails it at timeout_s
        except (CellError, concurrent.futures.TimeoutError) as e:
            raise AdminError(f"{name}: {e}") from e
        if reply.status is Status.ERROR:  # the server refused or failed it: its reason is the message
            raise AdminError(printable(reply.reason) or f"{name}: refused")  # it may quote a site's text
        if reply.status is not Status.OK:
            raise AdminError(f"{name}: the server did not answer ({reply.status.value}: {reply.reason})")
        if not reply.frames:
            return None
        return json.loads(bytes(reply.frames[0]))

    def submit(self, job_folder: Path) -> dict[str, Any]:
        """Check the job here, send it, return the server's record of it (``job_id`` ...).

        Raises:
            ConfigError: The job is not valid (every problem listed); nothing was sent.
        """
        problems = validate_job(job_folder)
        if problems:
            raise ConfigError(problems)
        folder = Path(tempfile.mkdtemp(prefix="flengine-submit-"))
        try:
            archive = pack_job(Path(job_folder), folder / "job.zip")
            size, digest = archive.stat().st_size, archive_digest(archive)
            ref = self.endpoint.service.add_file(
                archive, protocol.ARCHIVE_CHUNK_BYTES, [self.kit.server.name], 120.0, owned_folder=folder
            )
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return self.command("submit", ref=ref, size=size, digest=digest)

    def download(self, job_id: str, dest: Path) -> Path:
        """Download a finished job's server workspace into ``dest/<job_id>``; return that folder."""
        answer = self.command("download", job_id=job_id)
        target = Path(dest) / job_id
        if target.exists():
            raise UsageError(f"{target} exists already; remove it or download elsewhere (-o DIR)")
        size = answer.get("size")
        if type(size) is not int or size <= 0:
            raise AdminError("download: the server announced no archive")
        target.parent.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="flengine-download-"))
        try:
            archive = pull_archive(
                self.endpoint.cell,
                self.kit.server.name,
                str(answer["ref"]),
                folder / "results.zip",
                size,
                str(answer.get("digest")),
                f"the results of job {job_id}",
            )
            return unpack_job(
                archive, target, max_files=protocol.RESULTS_MAX_FILES, max_bytes=protocol.RESULTS_MAX_BYTES
            )
        finally:
            shutil.rmtree(folder, ignore_errors=True)
