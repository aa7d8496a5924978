"""`ScaffoldClient` against SCAFFOLD's update written out with numpy (Karimireddy et al., 2020, option II)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from engine.client import ScaffoldClient
from engine.model import FLModel
from engine.model.scaffold_keys import C_DELTA_KEY, C_GLOBAL_KEY

RNG = np.random.default_rng(7)
X = RNG.normal(size=(16, 3)).astype(np.float64)
T = RNG.normal(size=(16, 1)).astype(np.float64)


def _gradient(w: np.ndarray) -> np.ndarray:
    """d/dw of mean((X w^T - T)^2) for a (1, 3) weight."""
    residual = X @ w.T - T
    return (2 / len(X)) * (residual.T @ X)


def _reference_round(x: np.ndarray, c: np.ndarray, c_i: np.ndarray, lrs: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """The trained weights and the control variate change of one SCAFFOLD round, in numpy."""
    y = x.copy()
    for lr in lrs:
        y = y - lr * _gradient(y)  # the optimizer step
        y = y - lr * (c - c_i)  # the correction
    c_plus = c_i - c + (x - y) / sum(lrs)
    return y, c_plus - c_i


def _train(net: nn.Linear, scaffold: ScaffoldClient, lrs: list[float]) -> None:
    inputs, targets = torch.from_numpy(X), torch.from_numpy(T)
    for lr in lrs:
        optimizer = torch.optim.SGD(net.parameters(), lr=lr)
        optimizer.zero_grad()
        ((net(inputs) - targets) ** 2).mean().backward()
        optimizer.step()
        scaffold.correct(lr)


def test_two_rounds_match_the_formula() -> None:
    net = nn.Linear(3, 1, bias=False).double()
    scaffold = ScaffoldClient(net)
    x = RNG.normal(size=(1, 3))
    c_i = np.zeros((1, 3))
    for round_lrs in ([0.1, 0.1, 0.1], [0.05, 0.02]):
        c = RNG.normal(size=(1, 3))
        with torch.no_grad():
            net.weight.copy_(torch.from_numpy(x))
        scaffold.begin_round(FLModel(params={}, meta={C_GLOBAL_KEY: {"weight": torch.from_numpy(c)}}))

        _train(net, scaffold, round_lrs)
        meta = scaffold.end_round()

        expected_y, expected_delta = _reference_round(x, c, c_i, round_lrs)
        np.testing.assert_allclose(net.weight.detach().numpy(), expected_y, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(meta[C_DELTA_KEY]["weight"].numpy(), expected_delta, rtol=1e-10, atol=1e-12)
        c_i = c_i + expected_delta
        np.testing.assert_allclose(scaffold.c_local["weight"].numpy(), c_i, rtol=1e-10, atol=1e-12)
        x = RNG.normal(size=(1, 3))


def test_first_round_without_a_server_variate_is_plain_sgd() -> None:
    net = nn.Linear(3, 1, bias=False).double()
    scaffold = ScaffoldClient(net)
    x = net.weight.detach().numpy().copy()
    scaffold.begin_round(FLModel(params={}))

    _train(net, scaffold, [0.1, 0.1])
    delta = scaffold.end_round()[C_DELTA_KEY]["weight"].numpy()

    expected_y, expected_delta = _reference_round(x, np.zeros((1, 3)), np.zeros((1, 3)), [0.1, 0.1])
    np.testing.assert_allclose(net.weight.detach().numpy(), expected_y, rtol=1e-10)
    np.testing.assert_allclose(delta, expected_delta, rtol=1e-10)


def test_a_round_without_steps_changes_nothing() -> None:
    net = nn.Linear(3, 1, bias=False)
    scaffold = ScaffoldClient(net)
    scaffold.begin_round(FLModel(params={}, meta={C_GLOBAL_KEY: {"weight": torch.ones(1, 3)}}))

    delta = scaffold.end_round()[C_DELTA_KEY]["weight"]

    assert torch.equal(delta, torch.zeros(1, 3))
    assert torch.equal(scaffold.c_local["weight"], torch.zeros(1, 3))


@pytest.mark.parametrize(
    ("c_global", "match"),
    [
        ({"nope": torch.zeros(1)}, "'nope' is not a trainable parameter"),
        ({"weight": torch.zeros(2, 3)}, r"'weight' has shape \(2, 3\), the parameter \(1, 3\)"),
        ({"weight": torch.full((1, 3), float("nan"))}, "'weight' holds a value that is not finite"),
        ([1, 2], "expected a dict of tensors, got list"),
    ],
    ids=["unknown-name", "wrong-shape", "nan", "not-a-dict"],
)
def test_a_bad_server_variate_is_refused_before_anything_changes(c_global: object, match: str) -> None:
    net = nn.Linear(3, 1, bias=False)
    before = net.weight.detach().clone()
    scaffold = ScaffoldClient(net)

    with pytest.raises(ValueError, match=match):
        scaffold.begin_round(FLModel(params={}, meta={C_GLOBAL_KEY: c_global}))

    assert torch.equal(net.weight.detach(), before)


@pytest.mark.parametrize("lr", [0, -0.1, float("nan"), True], ids=["zero", "negative", "nan", "bool"])
def test_a_bad_learning_rate_is_refused(lr: object) -> None:
    scaffold = ScaffoldClient(nn.Linear(3, 1))
    scaffold.begin_round(FLModel(params={}))

    with pytest.raises(ValueError, match="lr must be a finite number > 0"):
        scaffold.correct(lr)  # type: ignore[arg-type]


def test_correct_before_begin_round_says_what_to_call() -> None:
    with pytest.raises(RuntimeError, match=r"call begin_round\(received\) first"):
        ScaffoldClient(nn.Linear(3, 1)).correct(0.1)
