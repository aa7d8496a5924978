"""`RayWorkers`' options: what a worker actor reserves, from the command line or the job's resource_spec."""

from __future__ import annotations

import pytest

from engine.errors import UsageError
from engine.runtime.ray_backend import RayWorkers, _most


def test_an_actor_reserves_the_most_a_site_of_the_job_asks_for() -> None:
    spec = {"site-1": {"num_gpus": 1, "num_cpus": 2}, "site-2": {"num_gpus": 0.5}, "site-3": {"num_gpus": True}}

    assert _most(spec, "num_gpus", 0.0) == 1.0 and _most(spec, "num_cpus", 1.0) == 2.0
    assert _most({}, "num_gpus", 0.0) == 0.0 and _most(None, "num_cpus", 1.0) == 1.0
    assert _most({"site-1": {"num_gpus": -1}, "site-2": "two"}, "num_gpus", 0.0) == 0.0  # nonsense is ignored


@pytest.mark.parametrize("option", ["cpus", "gpus"])
def test_a_negative_reservation_is_a_usage_error(option: str) -> None:
    with pytest.raises(UsageError, match=f"--worker-{option}: expected a number >= 0"):
        RayWorkers(**{option: -1.0})


@pytest.mark.slow
def test_more_gpus_than_the_cluster_has_is_refused_instead_of_waiting_for_ever() -> None:
    pytest.importorskip("ray")
    import ray

    workers = RayWorkers(gpus=64)
    with pytest.raises(UsageError, match="a worker actor needs 64 GPU"):
        workers.open(1)
    assert not ray.is_initialized()
