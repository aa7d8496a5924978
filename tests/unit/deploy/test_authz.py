"""Who may do what: the whole role x action x job table, and a strict participants.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.deploy.authz import ACTIONS, authorize, load_participants, visible
from engine.errors import SecurityError
from engine.provision import ROLES, Participant, Project, ServerAddress
from engine.provision.kit import participants_file_text

# The table of engine/deploy/authz.py, written out per case. "own": the user submitted the job;
# "same-org": someone else of the user's org did; "other-org": someone of another org did. For
# shutdown, the target is a site of the user's org, a site of another org, or the server (or all).
EXPECTED = """
action    target       project_admin  org_admin  lead  member
submit    -            yes            yes        yes   no
byoc      -            yes            no         yes   no
list      -            yes            yes        yes   yes
list      own          yes            yes        yes   yes
list      same-org     yes            yes        yes   yes
list      other-org    yes            no         no    no
status    own          yes            yes        yes   yes
status    same-org     yes            yes        yes   yes
status    other-org    yes            no         no    no
abort     own          yes            yes        yes   no
abort     same-org     yes            yes        no    no
abort     other-org    yes            no         no    no
download  own          yes            yes        yes   no
download  same-org     yes            yes        no    no
download  other-org    yes            no         no    no
logs      own          yes            yes        yes   no
logs      same-org     yes            yes        no    no
logs      other-org    yes            no         no    no
clients   -            yes            yes        yes   yes
shutdown  org-site     yes            yes        no    no
shutdown  other-site   yes            no         no    no
shutdown  server       yes            no         no    no
"""


def _cases() -> list[Any]:
    lines = [line.split() for line in EXPECTED.strip().splitlines()]
    roles = lines[0][2:]
    return [
        pytest.param(role, action, target, answer == "yes", id=f"{role}-{action}-{target}")
        for action, target, *answers in lines[1:]
        for role, answer in zip(roles, answers, strict=True)
    ]


def _arguments(user: Participant, target: str) -> dict[str, str | None]:
    return {
        "-": {},
        "own": {"job_submitter": user.name, "job_org": user.org},
        "same-org": {"job_submitter": "someone", "job_org": user.org},
        "other-org": {"job_submitter": "someone", "job_org": "org-b"},
        "org-site": {"target_site_org": user.org},
        "other-site": {"target_site_org": "org-b"},
        "server": {"target_site_org": None},
    }[target]


def admin(role: str, name: str = "carol", org: str = "org-a") -> Participant:
    return Participant(name, "admin", org, role=role)


def test_the_table_covers_every_role_and_action() -> None:
    lines = [line.split() for line in EXPECTED.strip().splitlines()]

    assert tuple(lines[0][2:]) == ROLES
    assert {line[0] for line in lines[1:]} == set(ACTIONS)


@pytest.mark.parametrize(("role", "action", "target", "allowed"), _cases())
def test_each_role_may_do_what_the_table_says(role: str, action: str, target: str, allowed: bool) -> None:
    user = admin(role)

    reason = authorize(user, action, **_arguments(user, target))

    assert (reason is None) == allowed, reason
    if not allowed:
        assert reason is not None and reason.startswith(f"{role} carol may")


@pytest.mark.parametrize(
    ("role", "action", "arguments", "reason"),
    [
        (
            "member",
            "abort",
            {"job_submitter": "dave", "job_org": "org-a"},
            "member carol may not abort jobs; a member sees the jobs of their organisation and their status, read-only",
        ),
        ("member", "submit", {}, "member carol may not submit jobs; a member sees"),
        (
            "org_admin",
            "byoc",
            {},
            "org_admin carol may not submit jobs that bring their own code (custom/ files, or classes outside"
            " flengine's components); an org_admin submits jobs made of flengine's components",
        ),
        (
            "lead",
            "download",
            {"job_submitter": "dave", "job_org": "org-a"},
            "lead carol may download their own jobs only; a lead submits jobs",
        ),
        (
            "lead",
            "status",
            {"job_submitter": "dave", "job_org": "org-b"},
            "lead carol may see the status of the jobs of their organisation 'org-a' only",
        ),
        (
            "org_admin",
            "shutdown",
            {"target_site_org": None},
            "org_admin carol may shut down the sites of their organisation 'org-a' only",
        ),
        ("lead", "shutdown", {"target_site_org": "org-a"}, "lead carol may not shut down sites or the server"),
    ],
    ids=[
        "member-abort",
        "member-submit",
        "org-admin-byoc",
        "lead-download-other",
        "lead-status-other-org",
        "org-admin-server",
        "lead-shutdown",
    ],
)
def test_a_refusal_says_who_may_not_do_what(role: str, action: str, arguments: dict[str, str], reason: str) -> None:
    refusal = authorize(admin(role), action, **arguments)

    assert refusal is not None and refusal.startswith(reason)


def test_own_jobs_stay_the_users_after_they_change_org() -> None:
    lead = admin("lead", org="org-new")

    assert authorize(lead, "abort", job_submitter="carol", job_org="org-old") is None
    assert visible(lead, "carol", "org-old")


@pytest.mark.parametrize("kind", ["site", "server"])
@pytest.mark.parametrize("action", ACTIONS)
def test_the_server_and_sites_are_refused_every_admin_action(kind: str, action: str) -> None:
    participant = Participant("site-1" if kind == "site" else "server", kind, "org-a")  # type: ignore[arg-type]
    arguments = {"job_submitter": "site-1", "job_org": "org-a"} if action in {"status", "abort"} else {}

    reason = authorize(participant, action, **arguments)

    assert reason is not None and "only admin users run admin commands" in reason


@pytest.mark.parametrize("role", ROLES)
def test_an_unknown_action_is_refused(role: str) -> None:
    assert authorize(admin(role), "delete_everything") == (
        "unknown action 'delete_everything'; the actions are submit, byoc, list, status, abort, download, logs, clients, shutdown"
    )


def test_an_unknown_role_is_refused() -> None:
    reason = authorize(admin("superuser"), "clients")

    assert (
        reason == "admin carol has the unknown role 'superuser'; the roles are project_admin, org_admin, lead, member"
    )


@pytest.mark.parametrize(
    ("action", "arguments", "match"),
    [
        ("abort", {}, "an action on a job needs job_submitter and job_org"),
        ("status", {"job_submitter": "dave"}, "give both job_submitter and job_org"),
        ("submit", {"job_submitter": "dave", "job_org": "org-a"}, "this action is on no job"),
        ("clients", {"target_site_org": "org-a"}, "target_site_org is for 'shutdown' only"),
    ],
    ids=["job-missing", "half-a-job", "job-for-submit", "target-for-clients"],
)
def test_arguments_that_do_not_fit_the_action_are_a_bug_not_a_refusal(
    action: str, arguments: dict[str, str], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        authorize(admin("project_admin"), action, **arguments)


@pytest.mark.parametrize(
    ("role", "jobs_seen"),
    [
        ("project_admin", ["mine", "colleague", "stranger"]),
        ("lead", ["mine", "colleague"]),
        ("member", ["mine", "colleague"]),
    ],
    ids=["project-admin", "lead", "member"],
)
def test_list_shows_the_visible_jobs(role: str, jobs_seen: list[str]) -> None:
    user = admin(role)
    jobs = {"mine": ("carol", "org-a"), "colleague": ("dave", "org-a"), "stranger": ("erin", "org-b")}

    assert [job for job, (submitter, org) in jobs.items() if visible(user, submitter, org)] == jobs_seen


# participants.json


def _project() -> Project:
    return Project(
        "demo",
        ServerAddress("server", "127.0.0.1", 8002, "127.0.0.1"),
        (
            Participant("server", "server", "coordinator"),
            Participant("site-1", "site", "org-a", resources={"num_gpus": 1, "memory_gb": 16.5}),
            Participant("site-2", "site", "org-b"),
            Participant("alice", "admin", "coordinator", role="project_admin"),
            Participant("carol", "admin", "org-a", role="member"),
        ),
    )


def test_participants_json_as_provisioned_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "participants.json"
    path.write_text(participants_file_text(_project()), encoding="utf-8")

    participants = load_participants(path)

    assert list(participants.values()) == list(_project().participants)
    assert list(participants) == ["server", "site-1", "site-2", "alice", "carol"]


def _entries(**changes: Any) -> dict[str, Any]:
    """The participants of `_project` as participants.json lists them, with some entries replaced."""
    entries = json.loads(participants_file_text(_project()))["participants"]
    for name, entry in changes.items():
        if entry is None:
            del entries[name]
        else:
            entries[name] = entry
    return entries


_MALFORMED = [
    pytest.param("{not json", "Expecting property name", id="not-json"),
    pytest.param("[]", 'expected an object with the keys "project" and "participants"', id="a-list"),
    pytest.param(
        {"project": "demo"}, 'expected an object with the keys "project" and "participants"', id="no-participants"
    ),
    pytest.param(
        {"project": 7, "participants": _entries()},
        "project: expected the project's name, got 7",
        id="project-not-a-string",
    ),
    pytest.param(
        {"project": "demo", "participants": []},
        "participants: expected an object of identity -> entry, got list",
        id="participants-a-list",
    ),
    pytest.param(
        {"project": "demo", "participants": _entries(**{"site.1": {"kind": "site", "org": "x"}})},
        r'participants\["site.1"\]: not a valid identity',
        id="dotted-identity",
    ),
    pytest.param(
        {"project": "demo", "participants": _entries(**{"": {"kind": "site", "org": "x"}})},
        r'participants\[""\]: not a valid identity',
        id="empty-identity",
    ),
    pytest.param(
        {"project": "demo", "participants": _entries(carol={"kind": "robot", "org": "org-a"})},
        r'participants\["carol"\].kind: expected one of server, site, admin, got \'robot\'',
        id="unknown-kind",
    ),
    pytest.param(
        {"project": "demo", "participants": _entries(carol="member")},
        r'participants\["carol"\]: expected an object, got str',
        id="entry-a-string",
    ),
    pytest.param(
        {"project": "demo", "participants": _entries(carol={"kind": "admin", "org": "org-a"})},
        r'participants\["carol"\].role: expected one of project_admin, org_admin, lead, member, got None',
        id="admin-without-role",
    ),
    pytest.param(
        {"project": "demo", "participants": _entries(carol={"kind": "admin", "org": "org-a", "role": "root"})},
        r"got 'root'",
        id="unknown-role",
    ),
    pytest.param(
        {"project": "demo", "participants": _entries(**{"site-2": {"kind": "site", "org": "org-b", "role": "lead"}})},
        r"only admins have a role, this is a site",
        id="site-with-role",
    ),
    pytest.param(
        {"project": "demo", "participants": _entries(carol={"kind": "admin", "org": ["org-a"], "role": "member"})},
        r"org: expected an organisation's name on one line, got \['org-a'\]",
        id="org-a-list",
    ),
    pytest.param(
        {"project": "demo", "participants": _entries(carol={"kind": "admin", "org": "org-a\nadmin", "role": "member"})},
        r"org: expected an organisation's name on one line",
        id="org-two-lines",
    ),
    pytest.param(
        {
            "project": "demo",
            "participants": _entries(carol={"kind": "admin", "org": "org-a", "role": "member", "sudo": True}),
        },
        r"unknown keys \['sudo'\]",
        id="unknown-key",
    ),
    pytest.param(
        {
            "project": "demo",
            "participants": _entries(**{"site-2": {"kind": "site", "org": "org-b", "resources": {"num_gpus": -1}}}),
        },
        r"resources.num_gpus: expected an integer >= 0, got -1",
        id="negative-gpus",
    ),
    pytest.param(
        {"project": "demo", "participants": _entries(**{"site-2": {"kind": "site", "org": "org-b", "resources": []}})},
        r"resources: expected an object, got list",
        id="resources-a-list",
    ),
    pytest.param(
        {"project": "demo", "participants": _entries(server=None)},
        r"expected exactly one of kind server, got \[\]",
        id="no-server",
    ),
    pytest.param(
        {"project": "demo", "participants": _entries(Carol={"kind": "admin", "org": "org-a", "role": "lead"})},
        r"the same identity as 'carol', ignoring case",
        id="same-name-other-case",
    ),
    pytest.param(
        '{"project": "demo", "participants": {"server": {"kind": "server", "org": "c"}, "carol": {"kind": "admin", "org": "a", "role": "member"}, "carol": {"kind": "admin", "org": "a", "role": "project_admin"}}}',
        r"key 'carol' appears twice",
        id="duplicate-identity",
    ),
    pytest.param(
        '{"project": "demo", "participants": {"server": {"kind": "server", "org": "c"}, "s": {"kind": "site", "org": "a", "resources": {"memory_gb": NaN}}}}',
        r"NaN is not a JSON number",
        id="nan",
    ),
]


@pytest.mark.parametrize(("content", "match"), _MALFORMED)
def test_a_malformed_participants_file_is_refused_naming_the_file(tmp_path: Path, content: Any, match: str) -> None:
    path = tmp_path / "participants.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")

    with pytest.raises(SecurityError, match=match) as raised:
        load_participants(path)

    assert str(raised.value).startswith(f"{path}: not a participants file of this flengine: ")
    assert str(raised.value).endswith("; provision the server kit again")


def test_a_missing_participants_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "participants.json"

    with pytest.raises(SecurityError, match=f"^{path}: cannot read the participants file: No such file or directory$"):
        load_participants(path)
