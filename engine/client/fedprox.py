"""`fedprox_loss`: the proximal term of FedProx (Li et al., 2020), for a training script to add to its loss.

FedProx keeps each client's local training near the global model it received: the script adds
``mu / 2 * ||w - w_global||^2`` (over the module's trainable parameters) to its loss, so local
models of clients with very different data drift less. ``mu`` comes from the job's config,
e.g. ``task_script_args = "--mu 0.01"``; ``mu = 0`` is plain FedAvg.

Example:
    >>> received = flare.receive()
    >>> net.load_state_dict(received.params)
    >>> global_params = {name: t.detach().clone() for name, t in net.state_dict().items()}
    >>> loss = loss_fn(net(x), y) + flare.fedprox_loss(net, global_params, mu=0.01)
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch


def fedprox_loss(model: torch.nn.Module, global_params: Mapping[str, torch.Tensor], mu: float) -> torch.Tensor:
    """``mu / 2`` times the squared L2 distance of ``model``'s trainable parameters to ``global_params``.

    Args:
        model: The module being trained; only parameters with ``requires_grad`` count.
        global_params: The global model's params as received, by the module's parameter names
            (a state dict: buffers in it are ignored). They are not trained through.
        mu: The proximal weight, a finite number >= 0.

    Returns:
        A scalar tensor on the parameters' device, differentiable with respect to them (its
        gradient is ``mu * (w - w_global)``).

    Raises:
        ValueError: ``mu`` is negative or not finite, or a parameter is missing from
            ``global_params`` or has another shape there; the message names it.
    """
    if isinstance(mu, bool) or not isinstance(mu, (int, float)) or not math.isfinite(mu) or mu < 0:
        raise ValueError(f"fedprox_loss: mu must be a finite number >= 0, got {mu!r}")
    terms = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        reference = global_params.get(name)
        if reference is None:
            raise ValueError(f"fedprox_loss: parameter {name!r} of the model is not in global_params")
        if tuple(reference.shape) != tuple(param.shape):
            raise ValueError(
                f"fedprox_loss: parameter {name!r} has shape {tuple(param.shape)}, "
                f"global_params has {tuple(reference.shape)}"
            )
        reference = reference.detach().to(device=param.device, dtype=param.dtype)
        terms.append((param - reference).pow(2).sum())
    if not terms:
        return torch.zeros((), requires_grad=False)
    return (mu / 2) * torch.stack(terms).sum()
