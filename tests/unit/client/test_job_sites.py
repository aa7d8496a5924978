"""`get_site_index`, `get_num_sites` and `get_job_sites`: a site's place among the job's sites, at any site name."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from engine import client as flare
from engine.client.backends import (
    ENV_JOB_SITES,
    InProcessBackend,
    install_backend,
    job_sites_from_environment,
    job_sites_to_environment,
)
from engine.client.distributed import DistributedBackend, Ranks
from engine.client.exchange import TaskExchange
from engine.errors import ClientAPIError


@pytest.fixture
def installed() -> Iterator[None]:
    """No backend before the test; whatever the test installs is removed after it."""
    install_backend(None)
    yield
    install_backend(None)


def serve(site: str, job_sites: Sequence[str]) -> None:
    install_backend(InProcessBackend(TaskExchange(), site, "job-1", job_sites=job_sites))


@pytest.mark.parametrize(
    ("site", "job_sites", "index"),
    [
        pytest.param("site-1", ["site-1", "site-2"], 0, id="simulator-names"),
        pytest.param("lab-c", ["hospital-b", "lab-a", "lab-c"], 2, id="names-without-a-number"),
        pytest.param("hospital-b", ["hospital-b", "lab-a", "lab-c"], 0, id="first"),
        pytest.param("site-7", ["site-7", "site-3"], 0, id="the-position-not-the-number"),
        pytest.param("only", ["only"], 0, id="one-site"),
    ],
)
def test_the_index_is_the_sites_position_in_the_job_sites(
    installed: None, site: str, job_sites: list[str], index: int
) -> None:
    serve(site, job_sites)

    assert flare.get_site_index() == index
    assert flare.get_num_sites() == len(job_sites)
    assert flare.get_job_sites() == job_sites


def test_the_job_sites_returned_are_a_copy(installed: None) -> None:
    serve("lab-a", ["lab-a", "lab-b"])

    flare.get_job_sites().append("intruder")

    assert flare.get_job_sites() == ["lab-a", "lab-b"]


@pytest.mark.parametrize("call", [flare.get_site_index, flare.get_num_sites, flare.get_job_sites])
def test_unknown_job_sites_say_how_to_give_them(installed: None, call) -> None:
    serve("lab-a", [])

    with pytest.raises(ClientAPIError, match=r"^the job's sites are unknown to lab-a: .* --clients SITE,SITE`"):
        call()


def test_a_list_without_this_site_is_an_error(installed: None) -> None:
    serve("lab-a", ["lab-b", "lab-c"])

    with pytest.raises(ClientAPIError, match=r"this site 'lab-a' is not among the job's sites \['lab-b', 'lab-c'\]"):
        flare.get_site_index()


def test_without_init_the_calls_say_to_call_init(installed: None) -> None:
    with pytest.raises(ClientAPIError, match="call flare.init"):
        flare.get_site_index()


@pytest.mark.parametrize(
    "job_sites",
    [
        pytest.param(("lab-a", "hospital-b"), id="two"),
        pytest.param((), id="none"),
        pytest.param(("a,b", "x y"), id="odd-characters"),
    ],
)
def test_the_environment_of_a_subprocess_script_carries_the_sites(job_sites: tuple[str, ...]) -> None:
    environ = job_sites_to_environment(job_sites)

    assert job_sites_from_environment(environ) == job_sites


def test_no_variable_means_no_sites() -> None:
    assert job_sites_from_environment({}) == ()


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("lab-a,lab-b", id="not-json"),
        pytest.param('{"lab-a": 0}', id="not-a-list"),
        pytest.param('["lab-a", 2]', id="not-names"),
    ],
)
def test_a_malformed_variable_is_refused_by_name(text: str) -> None:
    with pytest.raises(ClientAPIError, match=rf"^flare.init\(\): {ENV_JOB_SITES}=.* is not a JSON list of site names"):
        job_sites_from_environment({ENV_JOB_SITES: text})


def test_every_rank_of_a_torchrun_script_knows_the_sites(installed: None) -> None:
    follower = DistributedBackend(Ranks(1, 2), None, "lab-c", "job-1", job_sites=["lab-a", "lab-c"])
    install_backend(follower)

    assert (flare.get_site_index(), flare.get_num_sites()) == (1, 2)
