"""What the keep-everything robust aggregators share: checks on accept, release, threads, blocks.

The helpers at the top (`on_disk`, `as_kind`, `result`) are used by the other test_robust_* files.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.aggregators import (
    CoordinateMedianAggregator,
    KeptResultsAggregator,
    KrumAggregator,
    TrimmedMeanAggregator,
)
from engine.aggregators.stacked import BlockStack, combine_values
from engine.fobs.arrays import tensor_bytes
from engine.model import FLModel, MetaKey, ParamsType
from engine.streaming.disk import DiskTensorConsumer
from engine.streaming.layout import StreamLayout
from engine.streaming.lazy import LazyRef

#: Small enough that the test tensors span several blocks, with boundaries inside tensors.
TINY_BLOCK_BYTES = 24


def on_disk(root: Path, tensors: dict[str, torch.Tensor], as_numpy: bool = False) -> dict[str, LazyRef]:
    """``tensors`` downloaded to disk under ``root``, as the lazy refs a received message holds."""
    layout = StreamLayout.of_tensors(tensors)
    chunk_bytes = 1 << 20
    consumer = DiskTensorConsumer(layout, chunk_bytes, root)
    for index in range(layout.chunk_count(chunk_bytes)):
        consumer.accept(index, layout.chunk(index, chunk_bytes, lambda name: memoryview(tensor_bytes(tensors[name]))))
    lazy = consumer.finish()
    refs = {name: lazy.make_lazy_ref(name, as_numpy=as_numpy) for name in tensors}
    lazy.release()
    return refs


def as_kind(tensors: dict[str, torch.Tensor], kind: str, root: Path) -> dict[str, Any]:
    """The same values as torch tensors, numpy arrays, lazy refs to tensors or lazy refs to arrays."""
    if kind == "tensor":
        return dict(tensors)
    if kind == "numpy":
        return {name: value.numpy() for name, value in tensors.items()}
    return on_disk(root, tensors, as_numpy=kind == "lazy-numpy")


def result(
    params: dict[str, Any], params_type: ParamsType = ParamsType.FULL, steps: int | None = 1, **metrics: float
) -> FLModel:
    meta = {} if steps is None else {MetaKey.NUM_STEPS_CURRENT_ROUND: steps}
    return FLModel(params=params, params_type=params_type, metrics=metrics or None, meta=meta, current_round=0)


def released(refs: dict[str, Any]) -> bool:
    return all(ref.released for ref in refs.values())


KEEP_ALL: dict[str, Callable[..., KeptResultsAggregator]] = {
    "median": lambda **kw: CoordinateMedianAggregator(**kw),
    "trimmed": lambda **kw: TrimmedMeanAggregator(trim_fraction=0.2, **kw),
    "krum": lambda **kw: KrumAggregator(num_byzantine=0, **kw),
}
ALL_KEEPERS = pytest.mark.parametrize("make", KEEP_ALL.values(), ids=KEEP_ALL.keys())


def weights(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3, 5), value), "b": torch.full((4,), -value)}


@ALL_KEEPERS
def test_a_second_result_of_a_contributor_is_refused(make) -> None:
    aggregator = make()
    aggregator.accept_model(result(weights(1.0)), "site-1")

    with pytest.raises(ValueError, match="site-1 already contributed to this round; a second result is refused"):
        aggregator.accept_model(result(weights(2.0)), "site-1")


@ALL_KEEPERS
def test_a_result_of_the_other_params_type_is_refused_alone(make) -> None:
    aggregator = make()
    for i in range(3):
        aggregator.accept_model(result(weights(float(i)), ParamsType.DIFF), f"site-{i}")

    with pytest.raises(ValueError, match="result of site-9 has FULL params but the accepted ones are DIFF"):
        aggregator.accept_model(result(weights(9.0), ParamsType.FULL), "site-9")

    aggregate = aggregator.aggregate_model()
    assert aggregate.params_type is ParamsType.DIFF and aggregate.meta["nr_aggregated"] == 3


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"w": torch.zeros(3, 5)}, r"missing 'b'"),
        ({**weights(0.0), "extra": torch.zeros(1)}, r"unexpected 'extra'"),
        ({"w": torch.zeros(5, 3), "b": torch.zeros(4)}, r"'w': shape \(5, 3\), expected \(3, 5\)"),
        ({"w": torch.zeros(3, 5, dtype=torch.float64), "b": torch.zeros(4)}, r"'w': dtype float64, expected float32"),
    ],
    ids=["missing", "unexpected", "shape", "dtype"],
)
@ALL_KEEPERS
def test_a_result_unlike_the_first_is_refused_naming_what_differs(make, params, match: str) -> None:
    aggregator = make()
    aggregator.accept_model(result(weights(1.0)), "site-1")

    with pytest.raises(
        ValueError,
        match=rf"result of site-2 does not match the model: {match} \(compared with the first accepted result, of site-1",
    ):
        aggregator.accept_model(result(params), "site-2")


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (3.0, r"param 'w' is a float; robust aggregators take torch tensors, numpy arrays or lazy references"),
        (torch.zeros(2, dtype=torch.complex64), r"param 'w': complex tensors cannot be aggregated"),
    ],
    ids=["number", "complex"],
)
def test_values_that_cannot_be_stacked_are_refused(value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=rf"result of site-1: {match}"):
        CoordinateMedianAggregator().accept_model(result({"w": value}), "site-1")


def test_a_result_without_params_is_refused() -> None:
    with pytest.raises(ValueError, match="result of site-1 carries no params; nothing to aggregate"):
        CoordinateMedianAggregator().accept_model(FLModel(metrics={"loss": 1.0}), "site-1")


def test_a_damaged_download_is_refused_when_accepted(tmp_path: Path) -> None:
    refs = on_disk(tmp_path, weights(1.0))
    os.truncate(refs["w"].file, 10)

    with pytest.raises(ValueError, match=r"result of site-1: param '\w': downloaded file .* is truncated"):
        CoordinateMedianAggregator().accept_model(result(refs), "site-1")


def test_nothing_to_aggregate_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="nothing to aggregate: no result was accepted"):
        CoordinateMedianAggregator().aggregate_model()


@ALL_KEEPERS
def test_lazy_refs_are_released_once_aggregated_and_their_files_go(make, tmp_path: Path) -> None:
    aggregator = make()
    refs = [on_disk(tmp_path, weights(float(i))) for i in range(3)]
    for i, params in enumerate(refs):
        aggregator.accept_model(result(params), f"site-{i}")
    assert not any(released(params) for params in refs)  # kept, not read, until the round ends

    aggregator.aggregate_model()

    assert all(released(params) for params in refs)
    assert list(tmp_path.iterdir()) == []


def test_reset_releases_the_kept_results(tmp_path: Path) -> None:
    aggregator = CoordinateMedianAggregator()
    refs = on_disk(tmp_path, weights(1.0))
    aggregator.accept_model(result(refs), "site-1")

    aggregator.reset_stats()

    assert released(refs)
    with pytest.raises(RuntimeError, match="nothing to aggregate"):
        aggregator.aggregate_model()


def test_excluded_params_are_left_out_and_released_at_once(tmp_path: Path) -> None:
    aggregator = CoordinateMedianAggregator(exclude_vars="^b$")
    refs = on_disk(tmp_path, weights(1.0))

    aggregator.accept_model(result(refs), "site-1")

    assert refs["b"].released and not refs["w"].released
    assert set(aggregator.aggregate_model().params) == {"w"}


@ALL_KEEPERS
def test_results_accepted_from_many_threads_are_all_kept(make) -> None:
    aggregator = make()
    count = 12
    barrier = threading.Barrier(count)
    errors: list[BaseException] = []

    def send(i: int) -> None:
        barrier.wait(timeout=10)
        try:
            aggregator.accept_model(result(weights(float(i))), f"site-{i}")
        except BaseException as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)

    assert errors == []
    assert aggregator.aggregate_model().meta["nr_aggregated"] == count


@pytest.mark.parametrize(
    ("make", "kwargs", "match"),
    [
        (CoordinateMedianAggregator, {"block_bytes": 0}, r"block_bytes: expected an integer >= 1 \(bytes per client and block\), got 0"),
        (CoordinateMedianAggregator, {"exclude_vars": "("}, r"exclude_vars: '\(' is not a valid regular expression"),
        (TrimmedMeanAggregator, {"trim_fraction": 0.5}, r"trim_fraction: expected a number in \[0, 0.5\), got 0.5"),
        (TrimmedMeanAggregator, {"trim_fraction": -0.1}, r"trim_fraction: expected a number in \[0, 0.5\), got -0.1"),
        (TrimmedMeanAggregator, {"trim_fraction": "0.2"}, r"trim_fraction: expected a number in \[0, 0.5\), got '0.2'"),
        (KrumAggregator, {"num_byzantine": -1}, r"num_byzantine: expected an integer >= 0, got -1"),
        (KrumAggregator, {"num_byzantine": 1.5}, r"num_byzantine: expected an integer >= 0, got 1.5"),
        (KrumAggregator, {"num_byzantine": 1, "num_selected": 0}, r"num_selected: expected an integer >= 1, got 0"),
        (KrumAggregator, {"num_byzantine": True}, r"num_byzantine: expected an integer >= 0, got True"),
        (KrumAggregator, {"num_byzantine": 1, "max_local_steps": 0}, r"max_local_steps: expected a finite number > 0"),
        (KrumAggregator, {"num_byzantine": 1, "aggregation_weights": {"site-1": -1}}, r"aggregation_weights.site-1: expected a finite number >= 0"),
    ],
    ids=[
        "block-bytes", "exclude-regex", "trim-half", "trim-negative", "trim-string",
        "byzantine-negative", "byzantine-float", "selected-zero", "byzantine-bool", "max-steps", "weights",
    ],
)  # fmt: skip
def test_bad_args_are_refused_naming_the_arg_and_the_range(make, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make(**kwargs)


def test_block_stack_reads_the_same_block_of_each_value_whatever_holds_it(tmp_path: Path) -> None:
    source = [torch.arange(10, dtype=torch.float16) + 100 * i for i in range(3)]
    values = [source[0], source[1].numpy(), on_disk(tmp_path, {"x": source[2]})["x"]]

    blocks = [(start, rows.clone()) for start, rows in BlockStack(values, block_bytes=8)]

    assert [start for start, _ in blocks] == [0, 4, 8]
    assert all(rows.dtype == torch.float32 for _, rows in blocks)
    assert torch.equal(torch.cat([rows for _, rows in blocks], dim=1), torch.stack(source).float())


def test_combine_values_keeps_shape_dtype_and_the_container_kind() -> None:
    values = [np.arange(6, dtype=np.int64).reshape(2, 3) + i for i in range(3)]

    combined = combine_values(values, lambda rows, spare: rows.mean(0) + 0.4, block_bytes=16)

    assert isinstance(combined, np.ndarray) and combined.dtype == np.int64
    assert combined.tolist() == [[1, 2, 3], [4, 5, 6]]  # means 1..6 plus 0.4, rounded
