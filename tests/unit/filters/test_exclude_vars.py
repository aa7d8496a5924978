"""ExcludeVars: removes named params on the FedAvg (FLModel) and ScatterAndGather (DXO) paths."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.filters import ExcludeVars, Filter
from engine.model import (
    DXO,
    DataKind,
    FLModel,
    ReservedHeaderKey,
    Shareable,
    model_from_shareable,
    shareable_from_model,
)

NAMES = ["fc.weight", "fc.bias", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]


def state() -> dict[str, torch.Tensor]:
    return {name: torch.zeros(1) for name in NAMES}


def via_model(params: dict[str, torch.Tensor]) -> Shareable:
    return shareable_from_model(FLModel(params=params))


def via_dxo(params: dict[str, torch.Tensor]) -> Shareable:
    return DXO(DataKind.WEIGHTS, params).to_shareable()


@pytest.mark.parametrize("carry", [via_model, via_dxo], ids=["flmodel", "dxo"])
@pytest.mark.parametrize(
    ("exclude_vars", "kept"),
    [
        (["bn.running_mean", "bn.running_var"], ["fc.weight", "fc.bias", "bn.num_batches_tracked"]),
        (r"running_(mean|var)$", ["fc.weight", "fc.bias", "bn.num_batches_tracked"]),
        (r"^bn\.", ["fc.weight", "fc.bias"]),
        ("bias", ["fc.weight", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]),
        (["bias"], NAMES),  # a list holds exact names, not patterns
        ([], NAMES),
    ],
    ids=["names", "regex", "anchored-regex", "regex-searches", "names-are-exact", "empty-list"],
)
def test_matching_params_are_removed(carry: Any, exclude_vars: list[str] | str, kept: list[str]) -> None:
    original = state()
    shareable = carry(original)

    result = ExcludeVars(exclude_vars=exclude_vars).process(shareable, "site-1")

    assert result is shareable
    assert list(model_from_shareable(result).params) == kept
    assert list(original) == NAMES  # the dict the caller passed in is not touched


def test_headers_and_meta_survive() -> None:
    shareable = DXO(DataKind.WEIGHT_DIFF, state(), {"NUM_STEPS_CURRENT_ROUND": 5}).to_shareable()
    shareable.set_header(ReservedHeaderKey.CURRENT_ROUND, 3)

    result = ExcludeVars(exclude_vars="bn").process(shareable, "site-1")

    dxo = DXO.from_shareable(result)
    assert (dxo.data_kind, dxo.meta) == (DataKind.WEIGHT_DIFF, {"NUM_STEPS_CURRENT_ROUND": 5})
    assert result.get_header(ReservedHeaderKey.CURRENT_ROUND) == 3


@pytest.mark.parametrize(
    "make",
    [Shareable, lambda: shareable_from_model(FLModel(metrics={"bn.acc": 1.0}))],
    ids=["empty", "model-without-params"],
)
def test_shareables_without_params_pass_through(make: Any) -> None:
    shareable = make()
    before = dict(shareable)

    result = ExcludeVars(exclude_vars="bn").process(shareable, "site-1")

    assert result is shareable and dict(result) == before


@pytest.mark.parametrize(
    ("exclude_vars", "error", "match"),
    [
        ("running_(mean", ValueError, r"exclude_vars: 'running_\(mean' is not a valid regular expression: missing \)"),
        (3, TypeError, r"exclude_vars: expected a list of names or a regular expression string, got 3"),
        (["a", 1], TypeError, r"exclude_vars: expected a list of names .*, got \['a', 1\]"),
    ],
    ids=["bad-regex", "not-a-string", "not-all-strings"],
)
def test_bad_arguments_are_refused(exclude_vars: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ExcludeVars(exclude_vars=exclude_vars)


def test_is_a_filter() -> None:
    assert isinstance(ExcludeVars(exclude_vars=[]), Filter)
