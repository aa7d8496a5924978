"""A site's own policy: the default accepts every job of the project; the site narrows it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.errors import ConfigError
from engine.provision import SitePolicy, load_site_policy
from engine.provision.policy import default_policy_text


def test_the_default_policy_file_reads_as_the_default_policy(tmp_path: Path) -> None:
    (tmp_path / "policy.conf").write_text(default_policy_text("site-1", "demo"), encoding="utf-8")

    assert load_site_policy(tmp_path / "policy.conf") == SitePolicy()


@pytest.mark.parametrize(
    ("policy", "job", "refusal"),
    [
        (SitePolicy(), ("bob", "org-b", True), None),
        (SitePolicy(accept_submitters=("alice",)), ("bob", "org-a", False), "this site runs no jobs from 'bob'"),
        (
            SitePolicy(accept_orgs=("org-a",)),
            ("bob", "org-b", False),
            "this site runs no jobs from organisation 'org-b'",
        ),
        (SitePolicy(allow_custom_code=False), ("bob", "org-a", True), "this site runs no job that brings its own code"),
        (SitePolicy(allow_custom_code=False), ("bob", "org-a", False), None),
    ],
    ids=["default-runs-all", "other-submitter", "other-org", "custom-code-refused", "no-custom-code-runs"],
)
def test_a_policy_refuses_a_job_with_the_reason(
    policy: SitePolicy, job: tuple[str, str, bool], refusal: str | None
) -> None:
    reason = policy.refusal(*job)

    assert (reason or "").startswith(refusal or "") and (reason is None) == (refusal is None)


def test_a_bad_policy_names_the_key(tmp_path: Path) -> None:
    (tmp_path / "policy.conf").write_text("allow_custom_code = maybe\naccept_orgs = org-a\n", encoding="utf-8")

    with pytest.raises(ConfigError) as caught:
        load_site_policy(tmp_path / "policy.conf")

    assert [p.key_path for p in caught.value.problems] == [("allow_custom_code",), ("accept_orgs",)]
    assert 'expected true or false, got "maybe"' in str(caught.value)
