"""Who may do what: the admin roles of a project and the actions each may take, on whose jobs.

NVIDIA FLARE's role model, simplified to one fixed table: members read, leads run their own
jobs, org admins manage their organisation, the project admin manages everything. The roles
are those of the project file (`engine.provision.ROLES`); the server reads who has which from
its kit's ``participants.json`` (`load_participants`) and asks `authorize` before every admin
command.

==========  =============  ==================  ==================  ==================
action      project_admin  org_admin           lead                member
==========  =============  ==================  ==================  ==================
submit      yes            yes                 yes                 no
byoc        yes            no                  yes                 no
list        every job      their org's jobs    their org's jobs    their org's jobs
status      every job      their org's jobs    their org's jobs    their org's jobs
abort       every job      their org's jobs    their own jobs      no
download    every job      their org's jobs    their own jobs      no
logs        every job      their org's jobs    their own jobs      no
clients     yes            yes                 yes                 yes
shutdown    server, sites  their org's sites   no                  no
==========  =============  ==================  ==================  ==================

- ``byoc`` ("bring your own code", NVIDIA FLARE's right of that name) is asked at ``submit`` for
  a job that brings code of its own: files in an app's ``custom/`` folder, or a dotted path that
  is not one of flengine's components (`engine.config.job_code_of` lists why). As in FLARE's
  default policy, leads, who run studies, have it and org admins, who run their organisation's
  sites, do not: an org admin submits jobs made of flengine's components only. A site still
  refuses such a job when its own policy says ``allow_custom_code = false``.
- A job's org is its submitter's org when it was submitted (the job store keeps both).
- "Their own jobs" are the jobs they submitted. "Their org's jobs" include their own jobs, even
  one submitted while they belonged to another org.
- ``list`` answers with the jobs `visible` to the user; the command itself is open to every admin.
- ``shutdown`` of the server, or of everything (``shutdown all``), is the project admin's alone.
- The server and the sites are not admins: they are refused every action. So is an action not
  in the table, and an admin whose role is not one of the four.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Literal

from engine.cells.fqcn import is_valid_fqcn
from engine.errors import SecurityError
from engine.provision.project import ROLES, SERVER_NAME, Participant

#: Every action an admin command may ask for.
ACTIONS = ("submit", "byoc", "list", "status", "abort", "download", "logs", "clients", "shutdown")
#: Actions on one job: the caller names the job's submitter and org.
JOB_ACTIONS = frozenset({"list", "status", "abort", "download", "logs"})

Scope = Literal["any", "org", "own", "none"]
ANY: Scope = "any"  # every job or target
ORG: Scope = "org"  # jobs of the user's org (and their own), sites of the user's org
OWN: Scope = "own"  # jobs the user submitted
NONE: Scope = "none"

#: The table of the module docstring: role -> action -> on which jobs (or sites) it is allowed.
RULES: dict[str, dict[str, Scope]] = {
    "project_admin": dict.fromkeys(ACTIONS, ANY),
    "org_admin": {
        "submit": ANY,
        "byoc": NONE,
        "list": ORG,
        "status": ORG,
        "abort": ORG,
        "download": ORG,
        "logs": ORG,
        "clients": ANY,
        "shutdown": ORG,
    },
    "lead": {
        "submit": ANY,
        "byoc": ANY,
        "list": ORG,
        "status": ORG,
        "abort": OWN,
        "download": OWN,
        "logs": OWN,
        "clients": ANY,
        "shutdown": NONE,
    },
    "member": {
        "submit": NONE,
        "byoc": NONE,
        "list": ORG,
        "status": ORG,
        "abort": NONE,
        "download": NONE,
        "logs": NONE,
        "clients": ANY,
        "shutdown": NONE,
    },
}

_VERBS = {
    "submit": "submit",
    "list": "list",
    "status": "see the status of",
    "abort": "abort",
    "download": "download",
    "logs": "read the logs of",
}
_SUMMARIES = {
    "project_admin": "a project_admin may do everything",
    "org_admin": (
        "an org_admin submits jobs made of flengine's components, manages the jobs of their organisation"
        " and shuts down its sites"
    ),
    "lead": "a lead submits jobs, their own code included, manages their own and sees those of their organisation",
    "member": "a member sees the jobs of their organisation and their status, read-only",
}
_KINDS = ("server", "site", "admin")
_ORG_RE = re.compile(r"[^\x00-\x1f\x7f]{1,255}")  # as schemas/project.schema.json says
_ENTRY_KEYS = {"kind", "org", "role", "resources"}
_MAX_PARTICIPANTS_FILE_BYTES = 16 << 20


def authorize(
    user: Participant,
    action: str,
    *,
    job_submitter: str | None = None,
    job_org: str | None = None,
    target_site_org: str | None = None,
) -> str | None:
    """Decide whether ``user`` may take ``action``, by the table of this module.

    Args:
        user: Who asks, as `load_participants` read them.
        action: One of `ACTIONS`.
        job_submitter: The job's submitter, for an action on one job (every one of `JOB_ACTIONS`;
            ``list`` without a job asks whether the user may list at all).
        job_org: The job's org (its submitter's org at submission), with ``job_submitter``.
        target_site_org: For ``shutdown`` of one site: that site's org. None when the target is
            the server or every participant.

    Returns:
        None when the action is allowed, else the reason it is not, for the admin to read, e.g.
        ``"member carol may not abort jobs; a member sees the jobs of ..."``.

    Raises:
        ValueError: The job or target arguments do not fit the action (a bug of the caller, not
            a refusal): a job action without its job, job details for ``submit``...

    Example::

        reason = authorize(user, "abort", job_submitter=job.submitter, job_org=job.org)
        if reason is not None:
            return refuse(reason)
    """
    who = f"{user.role or user.kind} {user.name}"
    if user.kind != "admin":
        return f"{who} may not {action!r}: only admin users run admin commands"
    if action not in ACTIONS:
        return f"unknown action {action!r}; the actions are {', '.join(ACTIONS)}"
    _check_arguments(action, job_submitter, job_org, target_site_org)
    rules = RULES.get(user.role or "")
    if rules is None:
        return f"admin {user.name} has the unknown role {user.role!r}; the roles are {', '.join(ROLES)}"
    scope = rules[action]
    reason = _refusal(user, action, scope, job_submitter, job_org, target_site_org)
    return None if reason is None else f"{who} {reason}; {_SUMMARIES[user.role or '']}"


def visible(user: Participant, job_submitter: str, job_org: str) -> bool:
    """Whether ``list`` shows ``user`` a job submitted by ``job_submitter`` of ``job_org``."""
    return authorize(user, "list", job_submitter=job_submitter, job_org=job_org) is None


def load_participants(path: str | os.PathLike[str]) -> dict[str, Participant]:
    """Read the server kit's ``participants.json``: every identity of the project and its role.

    The file is read strictly, since it decides who may do what: any entry that `flengine
    provision` would not write refuses the whole file.

    Args:
        path: The ``participants.json`` of the server's kit.

    Returns:
        Identity -> participant, in file order.

    Raises:
        SecurityError: The file cannot be read or is malformed; the message names the file and
            the key, e.g. ``kit/participants.json: participants["site.1"]: not a valid identity``.
    """
    display = os.fspath(path)
    try:
        with Path(path).open("rb") as source:
            raw = source.read(_MAX_PARTICIPANTS_FILE_BYTES + 1)
    except OSError as e:
        raise SecurityError(f"{display}: cannot read the participants file: {e.strerror or e}") from e
    try:
        if len(raw) > _MAX_PARTICIPANTS_FILE_BYTES:
            raise ValueError(f"larger than {_MAX_PARTICIPANTS_FILE_BYTES} bytes")
        data = json.loads(raw, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
        return _participants_of(data)
    except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise SecurityError(
            f"{display}: not a participants file of this flengine: {e}; provision the server kit again"
        ) from e


def _check_arguments(action: str, job_submitter: str | None, job_org: str | None, target_site_org: str | None) -> None:
    if action in JOB_ACTIONS:
        if (job_submitter is None) != (job_org is None):
            raise ValueError(f"authorize({action!r}): give both job_submitter and job_org, or neither")
        if action != "list" and job_submitter is None:
            raise ValueError(f"authorize({action!r}): an action on a job needs job_submitter and job_org")
    elif job_submitter is not None or job_org is not None:
        raise ValueError(f"authorize({action!r}): this action is on no job; give no job_submitter or job_org")
    if action != "shutdown" and target_site_org is not None:
        raise ValueError(f"authorize({action!r}): target_site_org is for 'shutdown' only")


def _refusal(
    user: Participant,
    action: str,
    scope: Scope,
    job_submitter: str | None,
    job_org: str | None,
    target_site_org: str | None,
) -> str | None:
    """The refusal, after ``"<role> <name> "``; None when ``scope`` allows the action."""
    if scope == ANY:
        return None
    if action == "shutdown":
        if scope == ORG and target_site_org == user.org:
            return None
        if scope == ORG:
            return f"may shut down the sites of their organisation {user.org!r} only"
        return "may not shut down sites or the server"
    if action == "byoc":
        return "may not submit jobs that bring their own code (custom/ files, or classes outside flengine's components)"
    verb = _VERBS[action]
    if scope == NONE:
        return f"may not {verb} jobs"
    if job_submitter is None:  # `list` itself: the jobs shown are filtered with `visible`
        return None
    own = job_submitter == user.name
    if own or (scope == ORG and job_org == user.org):
        return None
    if scope == OWN:
        return f"may {verb} their own jobs only"
    return f"may {verb} the jobs of their organisation {user.org!r} only"


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise ValueError(f"key {key!r} appears twice")
        data[key] = value
    return data


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _participants_of(data: Any) -> dict[str, Participant]:
    if not isinstance(data, dict) or set(data) != {"project", "participants"}:
        raise ValueError('expected an object with the keys "project" and "participants"')
    if not isinstance(data["project"], str) or not data["project"]:
        raise ValueError(f"project: expected the project's name, got {data['project']!r}")
    entries = data["participants"]
    if not isinstance(entries, dict):
        raise ValueError(f"participants: expected an object of identity -> entry, got {type(entries).__name__}")
    participants: dict[str, Participant] = {}
    folded: dict[str, str] = {}
    for name, entry in entries.items():
        where = f"participants[{json.dumps(name)}]"
        participant = _participant_of(where, name, entry)
        if name.lower() in folded:
            raise ValueError(f"{where}: the same identity as {folded[name.lower()]!r}, ignoring case")
        folded[name.lower()] = name
        participants[name] = participant
    servers = [p.name for p in participants.values() if p.kind == "server"]
    if len(servers) != 1:
        raise ValueError(f"participants: expected exactly one of kind server, got {servers}")
    return participants


def _participant_of(where: str, name: str, entry: Any) -> Participant:
    if not is_valid_fqcn(name) or "." in name:
        raise ValueError(f"{where}: not a valid identity (letters, digits, '_' and '-', no dots)")
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected an object, got {type(entry).__name__}")
    unknown = set(entry) - _ENTRY_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    kind, org, role = entry.get("kind"), entry.get("org"), entry.get("role")
    if kind not in _KINDS:
        raise ValueError(f"{where}.kind: expected one of {', '.join(_KINDS)}, got {kind!r}")
    if name.lower() == SERVER_NAME and kind != "server":
        raise ValueError(f"{where}: the name {SERVER_NAME!r} is the server's alone")
    if not isinstance(org, str) or _ORG_RE.fullmatch(org) is None:
        raise ValueError(f"{where}.org: expected an organisation's name on one line, got {org!r}")
    if kind == "admin" and role not in ROLES:
        raise ValueError(f"{where}.role: expected one of {', '.join(ROLES)}, got {role!r}")
    if kind != "admin" and "role" in entry:
        raise ValueError(f"{where}.role: only admins have a role, this is a {kind}")
    resources = entry.get("resources", {})
    if kind != "site" and "resources" in entry:
        raise ValueError(f"{where}.resources: only sites declare resources, this is a {kind}")
    _check_resources(where, resources)
    return Participant(name, kind, org, role, dict(resources))


def _check_resources(where: str, resources: Any) -> None:
    if not isinstance(resources, dict):
        raise ValueError(f"{where}.resources: expected an object, got {type(resources).__name__}")
    for key, value in resources.items():
        if not isinstance(value, (int, float, str, bool)):
            raise ValueError(f"{where}.resources.{key}: expected a number, a string or a boolean, got {value!r}")
        if key == "num_gpus" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{where}.resources.num_gpus: expected an integer >= 0, got {value!r}")
        if key == "memory_gb" and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise ValueError(f"{where}.resources.memory_gb: expected a number >= 0, got {value!r}")
