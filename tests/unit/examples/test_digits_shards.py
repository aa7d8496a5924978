"""The digits shards: disjoint while the data has room, overlapping samples of their own for thousands of sites."""

from __future__ import annotations

import torch

from engine.examples.digits import DRAWN_SHARD_SAMPLES, batch_order, load_split


def _rows(shard: int, num_shards: int) -> set[tuple[float, ...]]:
    (images, _), _ = load_split(shard, num_shards)
    return {tuple(row.tolist()) for row in images}


def test_sites_split_the_training_data_between_them_while_it_has_room() -> None:
    first, second = _rows(0, 2), _rows(1, 2)
    assert not first & second and len(first) + len(second) > 1400
    forty = [_rows(k, 40) for k in range(40)]  # 35 samples each, still apart
    assert sum(len(rows) for rows in forty) == len(set().union(*forty)) > 1400


def test_ten_thousand_sites_each_get_a_window_of_their_own() -> None:
    shards = [load_split(shard, 10_000)[0] for shard in (0, 1, 5_000, 9_999)]

    assert all(len(labels) == DRAWN_SHARD_SAMPLES for _, labels in shards)
    drawn = [frozenset(tuple(row.tolist()) for row in images) for images, _ in shards]
    assert len(set(drawn)) == 4  # every site draws its own sample
    assert set(load_split(9_999, 10_000)[0][1].tolist()) == set(range(10))  # every digit, not one class


def test_batch_order_depends_on_the_site_and_the_round_only() -> None:
    def order(shard: int, current_round: int | None) -> list[int]:
        return torch.randperm(50, generator=batch_order(shard, current_round)).tolist()

    assert order(3, 2) == order(3, 2)
    assert order(3, 2) != order(3, 1) and order(3, 2) != order(4, 2)
    assert order(0, None) == order(0, 0)
