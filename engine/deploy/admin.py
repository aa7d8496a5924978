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
import time
from pathlib import Path
from typing import Any

from engine.cells import Cell, Message, Status
from engine.config import validate_job
from engine.deploy import protocol
from engine.deploy.archive import archive_digest, pack_job, unpack_job
from engine.deploy.reach import check_reachable
from engine.deploy.transfer import pull_archive
from engine.errors import AdminError as AdminError  # where callers import it from
from engine.errors import CellError, ConfigError, SecurityError, UsageError
from engine.provision import Kit
from engine.site import SiteEndpoint, SiteSettings
from engine.text import printable

#: Seconds an admin session waits for the server to accept its connection (its handshake and
#: registration), once its port answered (`engine.deploy.reach`: a dead server fails at once, a
#: refused kit within `REFUSAL_CHECK_S`). Only a server that takes the connection and never
#: answers waits this long; 10 s was too short for a server on a host whose cores were all busy.
CONNECT_TIMEOUT_S = 30.0
#: Seconds between two looks at whether the server refused the session's handshake while it waits.
REFUSAL_CHECK_S = 0.05
#: Seconds a command may take (a submit downloads the job; an abort waits for the job to stop).
COMMAND_TIMEOUT_S = 120.0


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
        # A refused or unanswered port fails here within REACH_TIMEOUT_S, not after CONNECT_TIMEOUT_S.
        check_reachable(self.kit.server.host, self.kit.server.port)
        settings = SiteSettings(self.kit.identity, self.kit.cell_settings(), self.kit.keys_dir)
        cell_name = f"{self.kit.identity}.{secrets.token_hex(4)}"
        endpoint = SiteEndpoint.for_site(
            settings, {}, connect_to=self.kit.server.connect_address, cell_name=cell_name, workspace=Path.cwd()
        )
        self._endpoint = endpoint.start()
        if not _wait_admitted(endpoint.cell, CONNECT_TIMEOUT_S):
            error = endpoint.cell.link_error
            self.close()
            if error is not None:
                raise SecurityError(
                    f"the server at {self.kit.server.connect_address} refused the kit of {self.kit.identity!r}: "
                    f"{error}; the kit belongs to another project, or {self.kit.identity!r} was revoked "
                    "(ask the project admin for a current kit)"
                )
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
        return answer_of(name, reply)

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
        ref, size, digest = download_offer(answer)
        target.parent.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="flengine-download-"))
        try:
            archive = pull_archive(
                self.endpoint.cell,
                self.kit.server.name,
                ref,
                folder / "results.zip",
                size,
                digest,
                f"the results of job {job_id}",
            )
            return unpack_job(
                archive, target, max_files=protocol.RESULTS_MAX_FILES, max_bytes=protocol.RESULTS_MAX_BYTES
            )
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def _wait_admitted(cell: Cell, timeout_s: float) -> bool:
    """Wait until the server registers ``cell`` (True), refuses it or ``timeout_s`` passes (False).

    After a refusal ``cell.link_error`` says why.

    A refused handshake sets no event that could be waited on (ZeroMQ goes on retrying it), so
    the wait for the registration is cut in slices of `REFUSAL_CHECK_S` and the refusal is read
    between them: a wrong or revoked kit fails within a slice instead of the whole timeout.
    """
    deadline_s = time.monotonic() + timeout_s
    while True:
        left_s = deadline_s - time.monotonic()
        if cell.wait_connected(max(0.0, min(REFUSAL_CHECK_S, left_s))):
            return True
        if cell.link_error is not None or left_s <= 0:
            return False


def answer_of(name: str, reply: Message) -> Any:
    """The JSON answer of command ``name`` in the server's reply (None for a reply without a body).

    Args:
        name: The command, for messages.
        reply: The server's reply, as the admin's cell received it.

    Raises:
        AdminError: The server refused or failed the command (its reason), did not answer, or
            answered with a body that is not JSON.
    """
    if reply.status is Status.ERROR:  # the server refused or failed it: its reason is the message
        raise AdminError(printable(reply.reason) or f"{name}: refused")  # it may quote a site's text
    if reply.status is not Status.OK:
        raise AdminError(f"{name}: the server did not answer ({reply.status.value}: {reply.reason})")
    if not reply.frames:
        return None
    try:
        return json.loads(bytes(reply.frames[0]))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError too
        raise AdminError(f"{name}: the server's answer is not JSON ({type(e).__name__}: {e})") from e


def download_offer(answer: Any) -> tuple[str, int, str]:
    """The ``ref``, ``size`` and ``digest`` of the server's answer to ``download``.

    Raises:
        AdminError: The answer announces no archive.
    """
    if not isinstance(answer, dict):
        raise AdminError(f"download: the server announced no archive (its answer is {type(answer).__name__})")
    ref, size, digest = answer.get("ref"), answer.get("size"), answer.get("digest")
    if type(size) is not int or size <= 0 or not isinstance(ref, str) or not isinstance(digest, str):
        raise AdminError("download: the server announced no archive (expected a ref, a size > 0 and a digest)")
    return ref, size, digest
