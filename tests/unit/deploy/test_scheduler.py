"""`place`: where a submitted job runs now, or why it waits, for real jobs loaded from their folders.

Each case writes the BenchNet job of the runtime tests with its own ``meta.conf`` (``deploy_map``,
``min_clients``, ``resource_spec``), loads it with `load_job`, and asks `place` about a project of
three sites, some connected, some with resources declared and some of them taken.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from engine.config import Job, load_job
from engine.deploy.scheduler import Impossible, Placement, SiteState, place
from tests.integration.runtime.jobkit import make_bench_job

PROJECT_SITES = ("site-1", "site-2", "site-3")
GPUS_2 = {"num_gpus": 2, "memory_gb": 64}


def bench_job(root: Path, meta: str) -> Job:
    """The BenchNet job under ``root`` with ``meta`` as its ``meta.conf``, loaded."""
    folder = make_bench_job(root)
    (folder / "meta.conf").write_text(f"name = bench\n{meta}\n", encoding="utf-8")
    return load_job(folder)


def sites(
    *names: str, resources: Mapping[str, Any] | None = None, **taken: Mapping[str, float]
) -> dict[str, SiteState]:
    """Connected sites by name, each declaring ``resources``; ``taken`` by site (``site_1=...``)."""
    return {name: SiteState(name, dict(resources or {}), dict(taken.get(name.replace("-", "_"), {}))) for name in names}


@dataclasses.dataclass(frozen=True)
class Case:
    meta: str
    connected: dict[str, SiteState]
    expected: Placement | str


CASES = {
    "named-sites-all-connected": Case(
        'min_clients = 2\ndeploy_map { app = ["server", "site-1", "site-2"] }',
        sites("site-1", "site-2", "site-3"),
        Placement(("site-1", "site-2"), {"site-1": {}, "site-2": {}}),
    ),
    "named-sites-in-deploy-map-order": Case(
        'min_clients = 2\ndeploy_map { app = ["server", "site-3", "site-1"] }',
        sites("site-1", "site-2", "site-3"),
        Placement(("site-3", "site-1"), {"site-3": {}, "site-1": {}}),
    ),
    "named-site-missing": Case(
        'min_clients = 2\ndeploy_map { app = ["server", "site-1", "site-2"] }',
        sites("site-1", "site-3"),
        "waiting for site-2 to connect",
    ),
    "named-sites-all-missing": Case(
        'min_clients = 1\ndeploy_map { app = ["server", "site-1", "site-2"] }',
        {},
        "waiting for site-1, site-2 to connect",
    ),
    "all-with-enough-clients": Case(
        'min_clients = 2\ndeploy_map { app = ["@ALL"] }',
        sites("site-2", "site-1"),
        Placement(("site-1", "site-2"), {"site-1": {}, "site-2": {}}),
    ),
    "all-takes-every-connected-site": Case(
        'min_clients = 1\ndeploy_map { app = ["@ALL"] }',
        sites("site-1", "site-2", "site-3"),
        Placement(("site-1", "site-2", "site-3"), {"site-1": {}, "site-2": {}, "site-3": {}}),
    ),
    "all-with-fewer-than-min-clients": Case(
        'min_clients = 3\ndeploy_map { app = ["@ALL"] }',
        sites("site-1", "site-2"),
        "waiting for clients: 2 of min_clients = 3 can take it now",
    ),
    "all-with-none-connected": Case(
        'min_clients = 1\ndeploy_map { app = ["@ALL"] }',
        {},
        "waiting for clients: 0 of min_clients = 1 can take it now",
    ),
    "named-sites-fewer-than-min-clients": Case(
        'min_clients = 3\ndeploy_map { app = ["server", "site-1", "site-2"] }',
        sites("site-1", "site-2", "site-3"),
        Impossible("deploy_map names 2 client sites, fewer than min_clients = 3"),
    ),
    "resources-fit-declared": Case(
        'min_clients = 1\ndeploy_map { app = ["server", "site-1"] }\nresource_spec { site-1 { num_gpus = 2 } }',
        sites("site-1", resources=GPUS_2),
        Placement(("site-1",), {"site-1": {"num_gpus": 2.0}}),
    ),
    "resources-fit-declared-minus-taken": Case(
        'min_clients = 1\ndeploy_map { app = ["server", "site-1"] }\n'
        "resource_spec { site-1 { num_gpus = 1, memory_gb = 32.5 } }",
        sites("site-1", resources=GPUS_2, site_1={"num_gpus": 1.0, "memory_gb": 31.5}),
        Placement(("site-1",), {"site-1": {"num_gpus": 1.0, "memory_gb": 32.5}}),
    ),
    "resources-do-not-fit-declared": Case(
        'min_clients = 1\ndeploy_map { app = ["server", "site-1"] }\nresource_spec { site-1 { num_gpus = 3 } }',
        sites("site-1", resources=GPUS_2),
        "waiting for resources: site-1: num_gpus: asks 3, 2 of 2 free",
    ),
    "resources-do-not-fit-what-is-left": Case(
        'min_clients = 1\ndeploy_map { app = ["server", "site-1"] }\nresource_spec { site-1 { num_gpus = 1 } }',
        sites("site-1", resources=GPUS_2, site_1={"num_gpus": 1.5}),
        "waiting for resources: site-1: num_gpus: asks 1, 0.5 of 2 free",
    ),
    "resources-not-declared-by-the-site": Case(
        'min_clients = 1\ndeploy_map { app = ["server", "site-1"] }\nresource_spec { site-1 { num_gpus = 1 } }',
        sites("site-1"),
        "waiting for resources: site-1: it declares no num_gpus",
    ),
    "resources-all-skips-the-site-that-is-full": Case(
        'min_clients = 1\ndeploy_map { app = ["@ALL"] }\n'
        "resource_spec { site-1 { num_gpus = 1 }, site-2 { num_gpus = 1 } }",
        sites("site-1", "site-2", resources=GPUS_2, site_1={"num_gpus": 2.0}),
        Placement(("site-2",), {"site-2": {"num_gpus": 1.0}}),
    ),
    "resources-all-too-few-sites-fit": Case(
        'min_clients = 2\ndeploy_map { app = ["@ALL"] }\n'
        "resource_spec { site-1 { num_gpus = 1 }, site-2 { num_gpus = 1 } }",
        sites("site-1", "site-2", resources=GPUS_2, site_1={"num_gpus": 2.0}),
        "waiting for clients: 1 of min_clients = 2 can take it now (site-1: num_gpus: asks 1, 0 of 2 free)",
    ),
    "site-not-in-the-project": Case(
        'min_clients = 1\ndeploy_map { app = ["server", "site-1", "site-9"] }',
        sites("site-1", "site-2", "site-3"),
        "deploy_map names sites that are not in the project: site-9",
    ),
    "site-not-in-the-project-even-when-connected": Case(
        'min_clients = 1\ndeploy_map { app = ["server", "site-9"] }',
        sites("site-9"),
        "deploy_map names sites that are not in the project: site-9",
    ),
    "resource-spec-a-string": Case(
        'min_clients = 1\ndeploy_map { app = ["server", "site-1"] }\nresource_spec { site-1 { num_gpus = two } }',
        sites("site-1", resources=GPUS_2),
        Impossible("resource_spec site-1.num_gpus = 'two' is not a number >= 0"),
    ),
    "resource-spec-a-boolean": Case(
        'min_clients = 1\ndeploy_map { app = ["server", "site-1"] }\nresource_spec { site-1 { num_gpus = true } }',
        sites("site-1", resources=GPUS_2),
        Impossible("resource_spec site-1.num_gpus = True is not a number >= 0"),
    ),
    "resource-spec-negative": Case(
        'min_clients = 1\ndeploy_map { app = ["server", "site-1"] }\nresource_spec { site-1 { num_gpus = -1 } }',
        sites("site-1", resources=GPUS_2),
        Impossible("resource_spec site-1.num_gpus = -1 is not a number >= 0"),
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_place(case: Case, tmp_path: Path) -> None:
    job = bench_job(tmp_path, case.meta)

    placed = place(job, case.connected, PROJECT_SITES)

    assert placed == case.expected
    assert isinstance(placed, Impossible) is isinstance(case.expected, Impossible)  # refused, not queued


def test_place_leaves_its_inputs_alone(tmp_path: Path) -> None:
    job = bench_job(
        tmp_path, 'min_clients = 1\ndeploy_map { app = ["@ALL"] }\nresource_spec { site-1 { num_gpus = 1 } }'
    )
    connected = sites("site-1", resources=GPUS_2, site_1={"num_gpus": 0.5})
    before = (copy.deepcopy(job.meta.data), copy.deepcopy(connected))

    place(job, connected, PROJECT_SITES)

    assert (job.meta.data, connected) == before
