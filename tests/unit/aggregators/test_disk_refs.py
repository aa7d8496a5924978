"""Aggregation of contributions downloaded to disk: real files, real `LazyRef`s."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine.aggregators import DXOAggregator, WeightedAggregationHelper
from engine.aggregators.weighted import release_values
from engine.model import DXO, DataKind, MetaKey, ReservedHeaderKey
from engine.streaming.disk import DiskTensorConsumer
from engine.streaming.layout import StreamLayout
from engine.streaming.lazy import LazyRef


def on_disk(root: Path, tensors: dict[str, torch.Tensor]) -> dict[str, LazyRef]:
    """``tensors`` downloaded to disk under ``root``, as the refs a received message holds."""
    layout = StreamLayout.of_tensors(tensors)
    consumer = DiskTensorConsumer(layout, 256, root)
    for index in range(layout.chunk_count(256)):
        data_of = lambda name: memoryview(tensors[name].numpy()).cast("B")  # noqa: E731
        consumer.accept(index, layout.chunk(index, 256, data_of))
    lazy = consumer.finish()
    return {name: lazy.make_lazy_ref(name) for name in tensors}


def contribution(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 8), value), "b": torch.full((8,), -value)}


def test_the_helper_sums_disk_refs_like_tensors_and_their_folders_go_once_released(tmp_path: Path) -> None:
    helper = WeightedAggregationHelper()
    first, second = on_disk(tmp_path, contribution(1.0)), on_disk(tmp_path, contribution(4.0))

    for refs, weight, site in ((first, 1.0, "site-1"), (second, 2.0, "site-2")):
        helper.add(refs, weight, site, 0)
        release_values(refs)
    result = helper.get_result()

    assert torch.allclose(result["w"], torch.full((4, 8), 3.0)) and torch.allclose(result["b"], torch.full((8,), -3.0))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("damage", "match"),
    [(lambda f: f.unlink(), "is gone"), (lambda f: os.truncate(f, 100), "is truncated")],
    ids=["deleted", "truncated"],
)
def test_a_damaged_contribution_is_refused_before_it_touches_the_sum(tmp_path: Path, damage, match: str) -> None:
    helper = WeightedAggregationHelper()
    good, bad = on_disk(tmp_path, contribution(1.0)), on_disk(tmp_path, contribution(9.0))
    helper.add(good, 1.0, "site-1", 0)
    damage(bad["w"].file)

    with pytest.raises(ValueError, match=rf"site-2: value '\w': .*{match}"):
        helper.add(bad, 1.0, "site-2", 0)

    result = helper.get_result()  # the sum is still whole: site-1 alone
    assert torch.equal(result["w"], torch.full((4, 8), 1.0))


def test_a_misfit_shape_is_refused_from_the_ref_without_reading_it(tmp_path: Path) -> None:
    helper = WeightedAggregationHelper()
    helper.add(on_disk(tmp_path, contribution(1.0)), 1.0, "site-1", 0)
    misfit = on_disk(tmp_path, {"w": torch.zeros(2, 2), "b": torch.zeros(8)})
    os.truncate(misfit["w"].file, 0)  # were it read or checked first, the error would say truncated

    with pytest.raises(ValueError, match=r"site-2: value 'w': shape \(2, 2\) differs"):
        helper.add({"w": misfit["w"]}, 1.0, "site-2", 0)


def test_the_dxo_aggregator_refuses_a_truncated_file_and_aggregates_the_rest(tmp_path: Path) -> None:
    aggregator = DXOAggregator()

    def result(value: float, steps: int):
        shareable = DXO(
            DataKind.WEIGHT_DIFF, on_disk(tmp_path, contribution(value)), {MetaKey.NUM_STEPS_CURRENT_ROUND: steps}
        ).to_shareable()
        shareable.set_header(ReservedHeaderKey.CURRENT_ROUND, 0)
        return shareable

    bad = result(7.0, 1)
    os.truncate(DXO.from_shareable(bad).data["w"].file, 10)
    accepted = [aggregator.accept(result(1.0, 1), "site-1", 0), aggregator.accept(bad, "site-2", 0)]
    accepted.append(aggregator.accept(result(4.0, 2), "site-3", 0))

    assert accepted == [True, False, True]
    mean = DXO.from_shareable(aggregator.aggregate(0)).data
    assert torch.allclose(mean["w"], torch.full((4, 8), 3.0))
    del bad
    assert list(tmp_path.iterdir()) == []  # accepted ones released, the refused one collected
