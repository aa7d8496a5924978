"""`fedprox_loss` against the formula computed here: mu/2 * sum ||w - w_g||^2, gradient mu * (w - w_g)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import client as flare


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    net[1].weight.requires_grad_(False)  # a frozen parameter does not count
    return net


def test_the_term_and_its_gradient_are_the_formula() -> None:
    net = _net()
    global_params = {name: t.detach().clone() + 0.5 for name, t in net.state_dict().items()}
    mu = 0.3

    loss = flare.fedprox_loss(net, global_params, mu)
    loss.backward()

    trained = [(name, p) for name, p in net.named_parameters() if p.requires_grad]
    expected = sum(float(((p.detach() - global_params[name]) ** 2).sum()) for name, p in trained) * mu / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    for name, p in trained:
        assert torch.allclose(p.grad, mu * (p.detach() - global_params[name]))
    assert net[1].weight.grad is None


def test_at_the_global_model_or_with_mu_0_it_is_zero() -> None:
    net = _net()
    same = {name: t.detach().clone() for name, t in net.state_dict().items()}
    assert flare.fedprox_loss(net, same, 0.5).item() == 0.0
    shifted = {name: t + 1.0 for name, t in same.items()}
    assert flare.fedprox_loss(net, shifted, 0).item() == 0.0


@pytest.mark.parametrize(
    ("mu", "message"),
    [(-0.1, "mu must be a finite number >= 0, got -0.1"), (float("nan"), "got nan"), (True, "got True")],
)
def test_a_bad_mu_is_refused(mu: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        flare.fedprox_loss(_net(), {}, mu)


def test_a_parameter_missing_or_of_another_shape_is_named() -> None:
    net = _net()
    params = {name: t.detach().clone() for name, t in net.state_dict().items()}
    del params["0.weight"]
    with pytest.raises(ValueError, match=r"parameter '0.weight' of the model is not in global_params"):
        flare.fedprox_loss(net, params, 0.1)
    params["0.weight"] = torch.zeros(2, 2)
    with pytest.raises(ValueError, match=r"parameter '0.weight' has shape \(3, 4\), global_params has \(2, 2\)"):
        flare.fedprox_loss(net, params, 0.1)
