"""Provisioning: a project file in, one startup kit per participant out.

``flengine provision project.conf -o DIR`` writes ``DIR/<participant>/`` for the server, every
site and every admin: its key pair, the public keys it must trust, ``kit.json`` (who it is and
where the server is), ``start.sh``, a site's own ``policy.conf``, and ``MANIFEST.json``. The
daemons open a kit with `load_kit`, which refuses a kit changed since it was provisioned.
Public API::

    from engine.provision import load_project, provision, load_kit, verify_kit
"""

from __future__ import annotations

from engine.provision.kit import KEYS_FOLDER, KIT_FILE, PARTICIPANTS_FILE, START_SCRIPT, Kit, load_kit
from engine.provision.manifest import MANIFEST_FILE, KitCheck, verify_kit
from engine.provision.policy import POLICY_FILE, SitePolicy, load_site_policy
from engine.provision.project import (
    ROLES,
    Participant,
    Project,
    ServerAddress,
    inspect_project,
    load_project,
    validate_project,
)
from engine.provision.provisioner import KitReport, ProvisionReport, provision

__all__ = [
    "KEYS_FOLDER",
    "KIT_FILE",
    "MANIFEST_FILE",
    "PARTICIPANTS_FILE",
    "POLICY_FILE",
    "ROLES",
    "START_SCRIPT",
    "Kit",
    "KitCheck",
    "KitReport",
    "Participant",
    "Project",
    "ProvisionReport",
    "ServerAddress",
    "SitePolicy",
    "inspect_project",
    "load_kit",
    "load_project",
    "load_site_policy",
    "provision",
    "validate_project",
    "verify_kit",
]
