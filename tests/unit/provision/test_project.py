"""The project file: read like a job's configs, and every problem named by file, line and key path."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.errors import ConfigError
from engine.provision import Participant, load_project, validate_project
from engine.provision.project import default_bind_host

from .conftest import WriteProject

REPO = Path(__file__).resolve().parents[3]


def test_a_project_file_lists_the_server_first_then_sites_and_admins(write_project: WriteProject) -> None:
    project = load_project(write_project())

    assert project.name == "demo"
    assert (project.server.name, project.server.connect_address, project.server.bind_host) == (
        "server",
        "tcp://127.0.0.1:8002",
        "127.0.0.1",
    )
    assert project.participants == (
        Participant("server", "server", "coordinator"),
        Participant("site-1", "site", "org-a", resources={"num_gpus": 1}),
        Participant("site-2", "site", "org-b"),
        Participant("alice", "admin", "coordinator", role="project_admin"),
    )


def test_the_same_project_in_json_reads_the_same(write_project: WriteProject) -> None:
    json_text = """\
    {"name": "demo", "server": {"host": "127.0.0.1", "port": 8002, "org": "coordinator"},
     "sites": [{"name": "site-1", "org": "org-a", "resources": {"num_gpus": 1}}, {"name": "site-2", "org": "org-b"}],
     "admins": [{"name": "alice", "org": "coordinator", "role": "project_admin"}]}
    """

    from_json = load_project(write_project(json_text, name="project.json"))

    assert from_json.participants == load_project(write_project()).participants


@pytest.mark.parametrize(
    ("host", "bind_host"),
    [("fl.example.org", "0.0.0.0"), ("127.0.0.1", "127.0.0.1")],
    ids=["dns-name-binds-all", "ip-address-binds-itself"],
)
def test_the_server_binds_its_own_address_or_all_interfaces(host: str, bind_host: str) -> None:
    assert default_bind_host(host) == bind_host


def test_the_example_project_of_the_docs_is_valid() -> None:
    assert validate_project(REPO / "docs" / "project.conf") == []


_BAD = [
    (
        {"{ name = site-2, org = org-b }": "{ name = site-1, org = org-b }"},
        [
            "project.conf:5: sites[1].name: duplicate name 'site-1', first used at sites[0].name (line 4) "
            "(names are identities: unique across the server, sites and admins, ignoring case)"
        ],
    ),
    (
        {"{ name = site-2, org = org-b }": "{ name = Alice, org = org-b }"},
        [
            "project.conf:8: admins[0].name: duplicate name 'alice', first used at sites[1].name (line 5) (names are identities: unique across the server, sites and admins, ignoring case)"
        ],
    ),
    (
        {"name = site-2,": "name = site.2,"},
        [
            'project.conf:5: sites[1].name: "site.2" is not a valid name (letters, digits, "_" and "-", starting with a letter or digit, and no dots: a name is a cell name, e.g. site-1)'
        ],
    ),
    (
        {"role = project_admin": "role = lead"},
        [
            'project.conf:7: admins: no admin has role "project_admin" (give one admin `role = project_admin`: the project\'s owner, who may do everything)'
        ],
    ),
    (
        {"role = project_admin": "role = owner"},
        ['project.conf:8: admins[0].role: must be one of "project_admin", "org_admin", "lead", "member", got "owner"'],
    ),
    (
        {"name = site-2,": "name = server,"},
        [
            "project.conf:5: sites[1].name: 'server' is reserved for the server (give this participant another name; every kit keeps the server's key as server.key)"
        ],
    ),
    (
        {"host = 127.0.0.1": 'host = "fl.example.org:8002"'},
        [
            "project.conf:2: server.host: 'fl.example.org:8002' is not a host name or an IP address (write the host alone, e.g. fl.example.org, and the port as `port`)"
        ],
    ),
    (
        {"host = 127.0.0.1": 'host = "::1"'},
        ["project.conf:2: server.host: IPv6 addresses are not supported yet (give a host name or an IPv4 address)"],
    ),
    (
        {"org = coordinator }": "org = coordinator, bind_host = eth0 }"},
        [
            "project.conf:2: server.bind_host: 'eth0' is not an IP address (an address of the server's host, or 0.0.0.0 for all interfaces)"
        ],
    ),
    (
        {"{ name = site-2, org = org-b }": "{ name = site-2 }"},
        ["project.conf:5: sites[1].org: missing required key (add `org = ...`, the participant's organisation)"],
    ),
    (
        {"{ name = site-2, org = org-b }": "{ name = site-2, org = org-b, gpus = 2 }"},
        ["project.conf:5: sites[1].gpus: unknown key 'gpus' (accepted: name, org, resources)"],
    ),
    (
        {"name = site-2,": "name = site-1,", "role = project_admin": "role = owner", "port = 8002": "port = x"},
        [
            'project.conf:2: server.port: expected an integer, got "x" (an integer in 1..65535, e.g. 8002)',
            "project.conf:5: sites[1].name: duplicate name 'site-1', first used at sites[0].name (line 4) (names are identities: unique across the server, sites and admins, ignoring case)",
            'project.conf:8: admins[0].role: must be one of "project_admin", "org_admin", "lead", "member", got "owner"',
        ],
    ),
]


@pytest.mark.parametrize(
    ("replace", "expected"),
    _BAD,
    ids=[
        "duplicate-name",
        "duplicate-ignoring-case",
        "dotted-name",
        "no-project-admin",
        "unknown-role",
        "server-is-reserved",
        "port-in-host",
        "ipv6-host",
        "bind-host-not-an-address",
        "missing-org",
        "unknown-key",
        "every-problem-at-once",
    ],
)
def test_a_bad_project_file_names_file_line_key_path_and_fix(
    write_project: WriteProject, replace: dict[str, str], expected: list[str]
) -> None:
    path = write_project(replace=replace)

    with pytest.raises(ConfigError) as caught:
        load_project(path)

    assert [str(problem) for problem in caught.value.problems] == expected


def test_a_missing_project_file_says_so(write_project: WriteProject) -> None:
    write_project()

    assert [str(p) for p in validate_project("nope.conf")] == [
        "nope.conf: no such file (give the path of a project file, e.g. project.conf)"
    ]
