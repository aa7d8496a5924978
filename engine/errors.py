"""The one exception hierarchy of flengine.

Every error a user can cause derives from :class:`FlengineError` and carries the exit code the
CLI returns for it, so ``engine.cli`` catches the base class once and prints a single
``Error: ...`` line instead of a traceback. Layers add their own subclasses here, next to
their siblings, so the whole hierarchy can be read in one place.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config.problems import Problem
    from engine.config.source import ConfigDocument


class FlengineError(Exception):
    """Base of every error flengine raises on purpose.

    Attributes:
        exit_code: Process exit status the CLI uses when this error ends a command.
    """

    exit_code: int = 1


class UsageError(FlengineError):
    """A command was called wrongly (bad option, missing path)."""

    exit_code = 2


class ConfigError(FlengineError):
    """A job folder or config file is invalid; holds every problem found, one per line.

    Args:
        problems: The problems, each naming its file, line and key path.
    """

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems: list[Problem] = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class IncludeRefused(ConfigError):
    """An include of a config file was refused; ``partial`` is the rest of the file, read without any include.

    `engine.config.job` checks ``partial`` too, so that one bad include does not hide the file's
    other problems. None when the file cannot be read without its includes (e.g. it refers to
    something only they define).

    Args:
        problems: The refused includes, each naming its file and line.
        partial: The file read with every include blanked out, or None.
    """

    def __init__(self, problems: Iterable[Problem], partial: ConfigDocument | None) -> None:
        super().__init__(problems)
        self.partial = partial


class PathOutsideError(FlengineError, ValueError):
    """A path from a job or config leaves the folder it must stay in (`engine.paths`; the message names the setting).

    Args:
        setting: The setting the path came from (``download_to_disk_dir``).
        detail: What is wrong with the path, and the fix (the message without the setting).
    """

    def __init__(self, setting: str, detail: str) -> None:
        super().__init__(f"{setting}: {detail}")
        self.setting = setting
        self.detail = detail


class DottedPathError(FlengineError):
    """A dotted path (``module.Class``) does not name anything importable.

    Attributes:
        message: What is wrong: the missing module or attribute, or what importing raised.
        hint: How to fix it, when there is an obvious fix.
    """

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message if hint is None else f"{message} ({hint})")
        self.message = message
        self.hint = hint


class ComponentBuildError(FlengineError):
    """Constructing a component from its config entry failed at run time.

    The message names the file, key path and dotted path of the component; the original
    exception is chained as ``__cause__``.
    """


class SerializationError(FlengineError):
    """An object cannot be turned into a FOBS message, or a message back into an object."""


class UnknownTypeError(SerializationError):
    """No decomposer is registered for a type (sending) or a wire type name (receiving)."""


class MalformedMessageError(SerializationError):
    """Bytes received are not a well-formed FOBS message (truncated, garbage, over a limit)."""


class JobArchiveError(FlengineError):
    """A job archive cannot be packed or is refused on unpacking (`engine.deploy.archive`).

    The message names the path or archive member and the rule it breaks, e.g.
    ``job.zip: member '../evil.py': a '..' part would leave the job folder``, or the limit its
    central directory is over: ``job.zip: more than 10000 members (600000 declared by its end record)``.
    """


class StreamingError(FlengineError):
    """A download cannot go on: a lying header, a chunk that does not fit, a failed consumer."""


class DownloadRefused(StreamingError):
    """A chunk request the sender will not serve (`engine.streaming.transactions`); the reason is sent back."""


class AnnouncementRefused(StreamingError):
    """What a sender announced about a stream (its size, kind or chunking) is refused by the
    receiver before anything is pulled: the sender's doing, not a lost link."""


class SecurityError(FlengineError):
    """Keys or trust settings are missing, malformed or unsafe, or a peer was refused for them.

    The message names the file and the fix (``chmod 600 ...``, the allowlist to add a key to).
    """


class ProvisionError(FlengineError):
    """Startup kits cannot be written as the project file says, or a kit cannot be read.

    For example a participant left the project file without ``--remove``, a kit folder is
    missing, a participant changed kind, or a ``kit.json`` is not one this flengine writes. The
    message names the folder or file and the fix; ``flengine provision`` has written nothing
    when it raises one.
    """


class CellError(FlengineError):
    """Base of the errors of the cells (messaging) layer."""


class CellClosedError(CellError):
    """The cell is not started, or it stopped before the operation could finish."""


class CellTimeoutError(CellError):
    """No reply came within the request's timeout; the message names target, channel and topic."""


class CellUnreachableError(CellError):
    """The target cell is not connected, vanished, or its connection dropped mid-request."""


class CellMessageTooLargeError(CellError):
    """A message exceeds ``max_message_size_bytes``; checked before any byte is sent."""


class CellRemoteError(CellError):
    """The peer answered with an error status (its handler raised, no handler, refused input)."""


class CellProtocolError(CellError):
    """Bytes from the network break the cells wire protocol.

    Raised only inside the cells layer while decoding; the I/O thread answers it with an error
    status or counts and logs it, and never lets it escape.
    """


class ResultRefused(FlengineError, ValueError):
    """A site's result cannot be used: the site's alone, the round goes on without it.

    Raised by the checks a result passes before it counts (`engine.aggregators.check_params_match`,
    non-finite values, a workflow's ``check_result``, an aggregator's ``accept_model``: wrong
    round, type, shape or weight, a second result) and by a task's ``result_received_cb``. The
    engine catches this class alone as a refusal: the result is logged without a traceback and
    reported in the round's ``refused``. Any other exception from a check is a bug in the check:
    it is logged with its traceback and the result counts as failed, not as refused.

    It is a `ValueError` too, so code that caught the ``ValueError`` these checks raised before
    still catches it.

    Example:
        A workflow's own check::

            def check_result(self, result, client, current_round, reference):
                super().check_result(result, client, current_round, reference)
                if result.meta.get("epochs", 0) < 1:
                    raise ResultRefused(f"result of {client}: trained no epoch")
    """


class FilterError(FlengineError):
    """A task data or result filter raised, or returned something that is not a Shareable.

    The message names the filter and the task (`engine.runtime.assembly.FilterChains`); the
    original exception is chained.
    """


class AccountantMissingError(FlengineError, ImportError):
    """``dp_accounting`` is not installed: the epsilon cannot be computed (the noise is still added).

    The message says how to install it (``pip install flengine[privacy]``).
    """


class ClientAPIError(FlengineError):
    """The Client API was used out of order, or the other side went away."""

    exit_code = 1


class ParamsHandedOverError(ClientAPIError):
    """The script read the params of an FLModel whose tensors `flare.send` handed to the engine."""


class IntoMismatchError(ClientAPIError):
    """The received params do not fit the tensors given as ``into`` (`flare.receive(into=...)`): nothing was written."""


class WorkflowError(FlengineError):
    """A workflow cannot go on: a client reported an error, progress stalled, too few clients are left.

    The message is the job's reason, so it names the client, the round and the setting involved.
    """


class CheckpointError(FlengineError):
    """A workflow's checkpoint cannot be used to resume: a missing file, a digest that does not match, a bad record.

    The message names the file, so a user can delete the checkpoint folder to start over, or restore it.
    """


class AdminError(FlengineError):
    """The server refused or failed an admin command; the message is the server's reason."""


class JobStoreError(FlengineError):
    """A job id that is malformed or unknown, or a change the job store refuses."""

    exit_code = 1


class PocError(FlengineError):
    """A POC command cannot do what was asked; the message names the folder and the fix."""
