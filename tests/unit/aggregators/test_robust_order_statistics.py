"""Order statistics by sorting network: the values a full sort puts at the wanted positions."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.aggregators.order_statistics import nan_as_largest, order_statistics, sorting_comparators


def all_binary_columns(count: int) -> torch.Tensor:
    """Every 0/1 vector of ``count`` values as one column: ``(count, 2**count)``."""
    return torch.tensor(list(itertools.product([0.0, 1.0], repeat=count))).T.contiguous()


@pytest.mark.parametrize("count", range(1, 12))
def test_the_network_sorts_every_zero_one_input_so_it_sorts_every_input(count: int) -> None:
    rows = all_binary_columns(count)
    expected = torch.sort(rows, dim=0).values

    ordered = order_statistics(rows.clone(), 0, count, torch.empty(rows.shape[1]))

    assert torch.equal(torch.stack(ordered), expected)  # the 0-1 principle: then any input is sorted


@pytest.mark.parametrize(
    ("count", "lo", "hi"),
    [(5, 2, 3), (6, 2, 4), (7, 1, 6), (16, 7, 9), (33, 16, 17), (40, 8, 32)],
    ids=["median-5", "median-6", "trim-7", "median-16", "median-33", "trim-40"],
)
def test_the_wanted_positions_hold_what_a_full_sort_puts_there(count: int, lo: int, hi: int) -> None:
    generator = torch.Generator().manual_seed(count)
    rows = torch.randn(count, 1000, generator=generator)
    expected = torch.sort(rows, dim=0).values[lo:hi]

    ordered = order_statistics(rows.clone(), lo, hi, torch.empty(1000))

    assert torch.equal(torch.stack(ordered), expected)


def test_comparators_no_wanted_position_needs_are_left_out() -> None:
    assert len(sorting_comparators(16, 7, 9)) < len(sorting_comparators(16, 0, 16))
    assert sorting_comparators(4, 0, 4) == ((0, 1), (2, 3), (0, 2), (1, 3), (1, 2))


def test_above_the_network_limit_torch_sort_gives_the_same() -> None:
    rows = torch.randn(9, 50, generator=torch.Generator().manual_seed(1))

    by_sort = order_statistics(rows.clone(), 3, 6, torch.empty(50), max_network_rows=4)
    by_network = order_statistics(rows.clone(), 3, 6, torch.empty(50))

    assert torch.equal(torch.stack(by_sort), torch.stack(by_network))


def test_positions_outside_the_rows_are_refused() -> None:
    with pytest.raises(ValueError, match=r"positions 2..4 are not positions of 4 rows"):
        sorting_comparators(4, 2, 5)


def test_nan_counts_as_the_largest_value() -> None:
    rows = torch.tensor([[float("nan"), 1.0], [2.0, float("-inf")], [3.0, float("inf")]])

    ordered = order_statistics(nan_as_largest(rows), 1, 2, torch.empty(2))

    assert ordered[0].tolist() == [3.0, 1.0]
