"""`GaussianPrivacy`: differential privacy for a client's update (clip to an L2 norm, add Gaussian noise)."""

from __future__ import annotations

import logging
import math
import secrets
import threading

import torch

from engine.errors import AccountantMissingError
from engine.filters.epsilon import PRIVACY_EXTRA, gaussian_epsilon
from engine.filters.filter import Filter
from engine.filters.updates import DP_EPSILON_METRIC, Update, blocks, check_number, update_of
from engine.model import Shareable

logger = logging.getLogger(__name__)

#: Result meta key that says why there is no ``dp_epsilon`` metric (``dp_accounting`` missing).
DP_EPSILON_NOTE = "dp_epsilon_note"


class GaussianPrivacy(Filter):
    """Clip a client's whole update to an L2 norm, add Gaussian noise, and report the epsilon spent.

    The Gaussian mechanism of DP-FedAvg (McMahan et al., "Learning differentially private
    recurrent language models", ICLR 2018), applied on the client: the update (every tensor of
    the weight difference together) is scaled by ``min(1, clip_norm / ||update||_2)``, then every
    value gets independent N(0, (noise_multiplier * clip_norm)^2) noise. Two passes over the
    tensors, a block at a time and in place: the norm, then scale-and-noise; no second copy of
    the model is made.

    The guarantee is per client and per round, for neighbouring runs that differ by one client's
    whole update (its data and all; L2 sensitivity ``clip_norm``). After each result it computes
    the epsilon spent so far at ``delta`` with the Rényi-DP accountant of Google's
    ``dp_accounting`` (``pip install flengine[privacy]``), composing one Poisson-sampled Gaussian
    event (``sampling_rate``, ``noise_multiplier``) per round from the first one to the result's
    round, logs ``dp epsilon site=... round=... epsilon=... delta=...`` and puts it in the result's
    metrics as ``dp_epsilon``, which the server averages into the round's metrics (every site
    with the same args reports the same value) in ``summary.json`` and the console. Without
    ``dp_accounting`` the noise is added all the same, a warning says once that the epsilon
    cannot be computed, and the result's meta says so under ``dp_epsilon_note``.

    It works on a weight difference (an `FLModel` with ``params_type`` DIFF, or a DXO of kind
    WEIGHT_DIFF); whole weights are refused with the fix (send DIFF), a result without params
    (a validation) passes unchanged. Put it last in the client's ``task_result_filters``.

    Args:
        clip_norm: The largest L2 norm of an update that is shared, > 0 (the sensitivity).
        noise_multiplier: The noise's standard deviation over ``clip_norm``, >= 0. 0 adds no
            noise and spends an infinite epsilon (clipping only: no privacy).
        delta: The delta of the reported (epsilon, delta) guarantee, in ``(0, 1)``; well under
            one over the number of clients. Default 1e-5.
        sampling_rate: The fraction of the clients each round samples, in ``(0, 1]`` (FedAvg's
            ``sample_fraction``, or ``num_clients`` over the job's clients). Default 1.0.
        seed: Seeds the noise, for tests that must repeat; None (the default) seeds it from the
            operating system's randomness. The generator is not cryptographically secure.

    Raises:
        ValueError: An argument outside its range, or not a number (NaN included).

    Example:
        In ``config_fed_client.conf`` (the training script sends a DIFF; FedAvg has
        ``expected_params_type = DIFF``)::

            task_result_filters = [
              { tasks = [train], filters = [
                { path = engine.filters.GaussianPrivacy,
                  args { clip_norm = 1.0, noise_multiplier = 1.1, delta = 1e-5, sampling_rate = 1.0 } } ] }
            ]
    """

    def __init__(
        self,
        clip_norm: float,
        noise_multiplier: float,
        delta: float = 1e-5,
        sampling_rate: float = 1.0,
        seed: int | None = None,
    ) -> None:
        self.clip_norm = check_number("clip_norm", clip_norm, 0.0, math.inf, low_open=True)
        if math.isinf(self.clip_norm):
            raise ValueError(f"clip_norm: expected a finite number > 0, got {clip_norm!r}")
        self.noise_multiplier = check_number("noise_multiplier", noise_multiplier, 0.0, 1e6)
        self.delta = check_number("delta", delta, 0.0, 1.0, low_open=True)
        if self.delta >= 1.0:
            raise ValueError(f"delta: expected a number in (0, 1), got {delta!r}")
        self.sampling_rate = check_number("sampling_rate", sampling_rate, 0.0, 1.0, low_open=True)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed: expected an integer >= 0 or None, got {seed!r}")
        self._generator = torch.Generator().manual_seed(seed if seed is not None else secrets.randbits(63))
        self._lock = threading.Lock()  # one result at a time: the generator and the count are shared
        self._releases = 0
        self._warned_missing = False
        if self.noise_multiplier == 0:
            logger.warning("GaussianPrivacy with noise_multiplier=0 adds no noise: it clips, and protects nothing")

    def process(self, shareable: Shareable, site: str) -> Shareable:
        """Clip and noise the carried weight difference in place, and add the epsilon spent to its metrics."""
        update = update_of(shareable, type(self).__name__)
        if update is None:
            return shareable
        with self._lock:
            scale = self._scale(update)
            self._noise(update, scale)
            self._releases += 1
            # The round decides how many sampled rounds were composed; the count of this filter's
            # own releases is a floor (a header that claims an early round cannot lower epsilon).
            rounds = max(update.current_round + 1 if update.current_round is not None else 0, self._releases)
        self._report(update, site, rounds)
        return shareable

    def _scale(self, update: Update) -> float:
        """Pass 1: the update's L2 norm over all tensors; the factor that clips it to ``clip_norm``."""
        squares = 0.0
        for name, tensor in update.tensors.items():
            part = 0.0
            for block in blocks(tensor):
                # In the block's dtype (float32 for half precision, whose squares overflow): a float64
                # copy of each block would cost more than the rest of the filter.
                wide = torch.float64 if block.dtype == torch.float64 else torch.float32
                part += float(torch.linalg.vector_norm(block.detach(), dtype=wide)) ** 2
            if not math.isfinite(part):
                raise ValueError(f"{type(self).__name__}: {name!r} holds NaN or infinite values")
            squares += part
        norm = math.sqrt(squares)
        return min(1.0, self.clip_norm / norm) if norm > 0 else 1.0

    def _noise(self, update: Update, scale: float) -> None:
        """Pass 2: scale each block and add N(0, (noise_multiplier * clip_norm)^2) noise, in place."""
        std = self.noise_multiplier * self.clip_norm
        with torch.no_grad():
            for tensor in update.tensors.values():
                for block in blocks(tensor):
                    if scale != 1.0:
                        block.mul_(scale)
                    if std > 0:
                        wide = torch.float64 if block.dtype == torch.float64 else torch.float32
                        noise = torch.empty(block.shape, dtype=wide).normal_(0.0, std, generator=self._generator)
                        block.add_(noise.to(block.device))

    def _report(self, update: Update, site: str, rounds: int) -> None:
        try:
            epsilon = gaussian_epsilon(self.noise_multiplier, self.sampling_rate, rounds, self.delta)
        except AccountantMissingError as e:
            if not self._warned_missing:
                self._warned_missing = True
                logger.warning("dp epsilon not computed site=%s: %s", site, e)
            logger.info(
                "dp epsilon site=%s round=%d epsilon=unknown delta=%g (%s)", site, rounds, self.delta, PRIVACY_EXTRA
            )
            update.add_meta(DP_EPSILON_NOTE, str(e))
            return
        logger.info("dp epsilon site=%s round=%d epsilon=%.4f delta=%g", site, rounds, epsilon, self.delta)
        if math.isfinite(epsilon):
            update.add_metric(DP_EPSILON_METRIC, epsilon)
        else:
            update.add_meta(DP_EPSILON_NOTE, "epsilon is infinite: noise_multiplier = 0 adds no noise")
