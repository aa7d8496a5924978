"""The epsilon a run of the Gaussian mechanism has spent, from Google's ``dp_accounting`` (extra ``privacy``).

One round of `GaussianPrivacy` is the sampled Gaussian mechanism: each round a client is in the
round's sample with probability ``sampling_rate`` and, if it is, releases its update clipped to
L2 norm C plus N(0, (noise_multiplier * C)^2) noise per value. The Rényi-DP accountant composes
one ``PoissonSampledDpEvent(sampling_rate, GaussianDpEvent(noise_multiplier))`` per round and
converts to the (epsilon, delta) guarantee. ``dp_accounting`` is imported on first use only.
"""

from __future__ import annotations

import functools
import math

from engine.errors import AccountantMissingError

#: How a user gets the optional package the epsilon needs.
PRIVACY_EXTRA = "pip install flengine[privacy]"


@functools.lru_cache(maxsize=256)
def gaussian_epsilon(noise_multiplier: float, sampling_rate: float, rounds: int, delta: float) -> float:
    """The epsilon of ``rounds`` rounds of the Poisson-sampled Gaussian mechanism at ``delta`` (RDP accountant).

    Args:
        noise_multiplier: Noise standard deviation over the clipping norm, >= 0 (0: infinite epsilon).
        sampling_rate: The probability that a client takes part in a round, in ``(0, 1]``.
        rounds: How many rounds were composed, >= 0 (0: epsilon 0).
        delta: The delta of the guarantee, in ``(0, 1)``.

    Raises:
        AccountantMissingError: ``dp_accounting`` is not installed; the message says how to install it.
    """
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    try:
        import dp_accounting
        from dp_accounting import rdp
    except ImportError as e:
        raise AccountantMissingError(
            f"the epsilon spent cannot be computed without the dp_accounting package: {PRIVACY_EXTRA}"
        ) from e
    event = dp_accounting.PoissonSampledDpEvent(sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier))
    accountant = rdp.RdpAccountant()
    accountant.compose(event, rounds)
    return float(accountant.get_epsilon(delta))
