"""The job's sites a deployment names: what a client daemon takes (and passes on as ``--clients``)."""

from __future__ import annotations

import pytest

from engine.deploy import protocol
from engine.deploy.client import is_job_site_list


@pytest.mark.parametrize(
    ("sites", "ok"),
    [
        pytest.param(["hospital-b", "lab-a"], True, id="two-sites"),
        pytest.param(["lab-a"], True, id="this-site-alone"),
        pytest.param(["lab-b", "lab-c"], False, id="without-this-site"),
        pytest.param([], False, id="empty"),
        pytest.param(None, False, id="missing"),
        pytest.param("lab-a,lab-b", False, id="a-string"),
        pytest.param(["lab-a", 7], False, id="not-a-name"),
        pytest.param(["lab-a", ""], False, id="empty-name"),
        pytest.param(["lab-a", "x,y"], False, id="comma-in-a-name"),
        pytest.param(["lab-a", "-h"], False, id="reads-as-an-option"),
        pytest.param(["lab-a", "lab-a"], False, id="twice"),
        pytest.param(["lab-a", *(f"s{i}" for i in range(protocol.MAX_JOB_SITES))], False, id="too-many"),
    ],
)
def test_a_deployment_names_distinct_plain_sites_with_this_one_among_them(sites: object, ok: bool) -> None:
    assert is_job_site_list(sites, "lab-a") is ok
