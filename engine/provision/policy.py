"""A site's own policy: which jobs it runs, decided by the site and not by the server.

``policy.conf`` sits in the site's kit, outside the kit's manifest so the site may edit it. The
client daemon reads it when it starts and asks `SitePolicy.refusal` about every job deployed to
it; a refusal goes back to the submitter with the reason.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from engine.config import load_config
from engine.config.schema import check_document, with_defaults
from engine.errors import ConfigError

POLICY_FILE = "policy.conf"
_ANY = "*"

DEFAULT_POLICY = """\
# The policy of site "{site}" in project "{project}": which jobs this site runs.
#
# This site controls this file, not the server: it is left out of the kit's MANIFEST.json, so
# editing it never makes the kit look tampered with. The client (`flengine client start`) reads
# it when it starts; restart the client after a change. Every key is in
# schemas/site_policy.schema.json.

# Admins whose jobs this site runs, by name (as in the project file); "*" for every admin.
accept_submitters = ["*"]

# Organisations whose admins' jobs this site runs; "*" for every organisation of the project.
accept_orgs = ["*"]

# Whether a job may bring its own code to run here: files in an app's custom/ folder (a
# training script, a model), or components named outside flengine's own packages (such as
# os.system). Its code runs with this site's rights: false runs only flengine's components.
allow_custom_code = true
"""


@dataclasses.dataclass(frozen=True)
class SitePolicy:
    """Which jobs a site runs.

    Attributes:
        accept_submitters: Admin names whose jobs run here; ``"*"`` for all (default).
        accept_orgs: Organisations whose admins' jobs run here; ``"*"`` for all (default).
        allow_custom_code: Whether a job may bring its own code (default True).
    """

    accept_submitters: tuple[str, ...] = (_ANY,)
    accept_orgs: tuple[str, ...] = (_ANY,)
    allow_custom_code: bool = True

    def refusal(self, submitter: str, org: str, has_custom_code: bool) -> str | None:
        """Why this site refuses a job, or None when it runs it.

        Args:
            submitter: The admin who submitted the job.
            org: The submitter's organisation.
            has_custom_code: Whether the job brings code of its own.
        """
        if _ANY not in self.accept_submitters and submitter not in self.accept_submitters:
            return f"this site runs no jobs from {submitter!r} (its policy's accept_submitters)"
        if _ANY not in self.accept_orgs and org not in self.accept_orgs:
            return f"this site runs no jobs from organisation {org!r} (its policy's accept_orgs)"
        if has_custom_code and not self.allow_custom_code:
            return "this site runs no job that brings its own code (its policy's allow_custom_code = false)"
        return None


def default_policy_text(site: str, project: str) -> str:
    """The ``policy.conf`` a new site kit starts with: every job of the project, custom code allowed."""
    return DEFAULT_POLICY.format(site=site, project=project)


def load_site_policy(path: str | os.PathLike[str]) -> SitePolicy:
    """Read and check a site's ``policy.conf``.

    Raises:
        ConfigError: The file cannot be read or breaks the schema; every problem is listed.
    """
    file = Path(path)
    document = load_config(file, os.fspath(path), file.resolve().parent)
    problems = check_document(document, "site_policy")
    if problems:
        raise ConfigError(problems)
    data = with_defaults(document.data, "site_policy")
    return SitePolicy(tuple(data["accept_submitters"]), tuple(data["accept_orgs"]), data["allow_custom_code"])
