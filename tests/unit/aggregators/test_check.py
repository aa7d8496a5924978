"""check_params_match: names, shapes and dtypes against the model, lazy values never resolved."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from engine.aggregators import check_params_match

from .lazy import LazyTensor

REFERENCE = {"w": torch.zeros(3, 2), "b": torch.zeros(2), "steps": torch.zeros((), dtype=torch.int64)}


@pytest.mark.parametrize(
    "params",
    [
        {"w": torch.ones(3, 2), "b": torch.ones(2), "steps": torch.tensor(4)},
        {"w": np.ones((3, 2), dtype=np.float32), "b": np.ones(2, dtype=np.float32), "steps": np.int64(4)},
        {"w": LazyTensor(torch.ones(3, 2), expose_layout=True), "b": LazyTensor(torch.ones(2)), "steps": 4},
    ],
    ids=["tensors", "numpy-same-dtypes", "lazy-and-number"],
)
def test_matching_params_pass(params: dict[str, Any]) -> None:
    check_params_match(REFERENCE, params, "site-1")


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"w": torch.ones(3, 2), "steps": torch.tensor(1)}, r"result of site-1 does not match the model: missing 'b'$"),
        (
            {**REFERENCE, "extra": torch.ones(1)},
            r"result of site-1 does not match the model: unexpected 'extra'$",
        ),
        ({**REFERENCE, "w": torch.ones(2, 3)}, r"'w': shape \(2, 3\), expected \(3, 2\)$"),
        ({**REFERENCE, "w": torch.ones(3, 2, dtype=torch.float16)}, r"'w': dtype float16, expected float32$"),
        ({**REFERENCE, "b": np.ones(2, dtype=np.float64)}, r"'b': dtype float64, expected float32$"),
        (
            {**REFERENCE, "w": LazyTensor(torch.ones(4), expose_layout=True)},
            r"'w': shape \(4,\), expected \(3, 2\)$",
        ),
        (
            {"w": torch.ones(1), "extra": torch.ones(1)},
            r"missing 'b', 'steps'; unexpected 'extra'; 'w': shape \(1,\), expected \(3, 2\)$",
        ),
    ],
    ids=["missing", "unexpected", "shape", "dtype", "numpy-dtype", "lazy-shape", "several"],
)
def test_mismatches_are_named(params: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_params_match(REFERENCE, params, "site-1")


def test_long_lists_are_cut_short() -> None:
    reference = {f"layer{i}": torch.zeros(1) for i in range(8)}

    with pytest.raises(ValueError, match=r"missing 'layer0', 'layer1', 'layer2', 'layer3', 'layer4' and 3 more$"):
        check_params_match(reference, {}, "site-1")


def test_lazy_values_are_not_resolved() -> None:
    lazy = LazyTensor(torch.ones(5), expose_layout=True)
    bare = LazyTensor(torch.ones(5))

    with pytest.raises(ValueError, match=r"'w': shape \(5,\)"):
        check_params_match(REFERENCE, {"w": lazy, "b": bare, "steps": torch.tensor(0)}, "site-1")

    assert lazy.resolve_calls == 0 and bare.resolve_calls == 0
