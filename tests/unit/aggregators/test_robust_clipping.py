"""NormClippingAggregator against the clipped weighted mean computed with numpy."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.aggregators import NormClippingAggregator
from engine.model import ParamsType

from .test_robust_kept import as_kind, released, result

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
KINDS = ["tensor", "numpy", "lazy", "lazy-numpy"]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float64: 1e-12}


def model_params(dtype: torch.dtype, generator: torch.Generator, scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {
        "w": (scale * torch.randn(5, 7, generator=generator)).to(dtype),
        "b": (scale * torch.randn(4, generator=generator)).to(dtype),
        "bn.num_batches_tracked": torch.randint(0, 100, (), generator=generator),
    }


def clipped_mean(
    params: list[dict[str, torch.Tensor]],
    weights: list[float],
    max_norm: float,
    base: dict[str, torch.Tensor] | None,
) -> dict[str, np.ndarray]:
    """The expected aggregate: float updates clipped to ``max_norm`` then weighted-averaged (numpy, float64)."""
    floats = [name for name, value in params[0].items() if value.is_floating_point()]

    def update(p: dict[str, torch.Tensor], name: str) -> np.ndarray:
        value = p[name].double().numpy()
        return value - base[name].double().numpy() if base is not None else value

    scales = []
    for p in params:
        norm = np.sqrt(sum(np.sum(update(p, name) ** 2) for name in floats))
        scales.append(min(1.0, max_norm / norm))
    total = sum(weights)
    expected = {}
    for name, first in params[0].items():
        if first.is_floating_point():
            mean = sum(w * s * update(p, name) for w, s, p in zip(weights, scales, params, strict=True)) / total
            expected[name] = mean + (base[name].double().numpy() if base is not None else 0.0)
        else:
            expected[name] = np.round(
                sum(w * p[name].double().numpy() for w, p in zip(weights, params, strict=True)) / total
            )
    return expected


def combinations():
    for kind in KINDS:
        for name, dtype in DTYPES.items():
            if not (dtype is torch.bfloat16 and "numpy" in kind):
                yield pytest.param(kind, dtype, id=f"{kind}-{name}")


@pytest.mark.parametrize("params_type", [ParamsType.FULL, ParamsType.DIFF], ids=["full", "diff"])
@pytest.mark.parametrize(("kind", "dtype"), list(combinations()))
def test_updates_are_clipped_then_averaged_with_fedavgs_weights(
    kind: str, dtype: torch.dtype, params_type: ParamsType, tmp_path: Path
) -> None:
    generator = torch.Generator().manual_seed(1)
    base = model_params(dtype, generator)
    params = [model_params(dtype, generator, scale=s) for s in (0.1, 1.0, 3.0, 0.5, 10.0)]
    if params_type is ParamsType.FULL:
        params = [
            {name: p[name] + base[name] if p[name].is_floating_point() else p[name] for name in p} for p in params
        ]
    steps = [1, 2, 3, 1, 2]
    loads = []
    aggregator = NormClippingAggregator(max_norm=4.0, aggregation_weights={"site-0": 2.0}, block_bytes=24)
    aggregator.start_round(0, lambda: loads.append(1) or as_kind(base, kind, tmp_path))
    for i, values in enumerate(params):
        aggregator.accept_model(result(as_kind(values, kind, tmp_path), params_type, steps=steps[i]), f"site-{i}")

    aggregate = aggregator.aggregate_model()

    weights = [2.0 * steps[0], *steps[1:]]
    expected = clipped_mean(params, weights, 4.0, base if params_type is ParamsType.FULL else None)
    assert aggregate.params_type is params_type
    assert len(loads) == (1 if params_type is ParamsType.FULL else 0)  # read once, and only for FULL results
    assert aggregate.meta["nr_aggregated"] == 5 and "site-4" in aggregate.meta["clipped"]
    for name, first in params[0].items():
        value = aggregate.params[name]
        assert isinstance(value, np.ndarray) is ("numpy" in kind)
        value = torch.as_tensor(value)
        assert value.dtype == first.dtype and value.shape == first.shape
        if first.is_floating_point():
            tolerance = TOLERANCE[dtype] * (
                10 if params_type is ParamsType.FULL else 1
            )  # global + mean, rounded once more
            np.testing.assert_allclose(value.double().numpy(), expected[name], rtol=tolerance, atol=tolerance)
        else:
            assert value.item() == expected[name]


def test_one_huge_update_moves_the_mean_by_at_most_max_norm_over_n() -> None:
    generator = torch.Generator().manual_seed(2)
    honest = [{"w": 0.01 * torch.randn(1000, generator=generator)} for _ in range(4)]
    attacker = {"w": 1e6 * torch.randn(1000, generator=generator)}
    aggregator = NormClippingAggregator(max_norm=1.0)
    for i, params in enumerate([*honest, attacker]):
        aggregator.accept_model(result(params, ParamsType.DIFF), f"site-{i}")

    aggregate = aggregator.aggregate_model()

    honest_share = torch.stack([p["w"] for p in honest]).sum(0) / 5
    assert aggregate.meta["clipped"] == ["site-4"]
    assert float(torch.linalg.vector_norm(aggregate.params["w"] - honest_share)) <= 1.0 / 5 + 1e-6


def test_updates_within_the_norm_give_fedavg() -> None:
    aggregator = NormClippingAggregator(max_norm=100.0)
    aggregator.accept_model(result({"w": torch.full((2,), 1.0)}, ParamsType.DIFF, steps=1), "site-1")
    aggregator.accept_model(result({"w": torch.full((2,), 3.0)}, ParamsType.DIFF, steps=3), "site-2")

    aggregate = aggregator.aggregate_model()

    assert aggregate.params["w"].tolist() == [2.5, 2.5] and aggregate.meta == {"nr_aggregated": 2, "clipped": []}


def test_a_full_result_needs_the_global_model() -> None:
    with pytest.raises(
        RuntimeError,
        match=r"needs the global model to clip FULL results, but the workflow gave none \(it did not call start_round\)",
    ):
        NormClippingAggregator(max_norm=1.0).accept_model(result({"w": torch.zeros(2)}), "site-1")


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"v": torch.zeros(2)}, r"result of site-1: param 'v' is not in the global model"),
        ({"w": torch.zeros(3)}, r"result of site-1: param 'w' has shape \(3,\), the global model's is \(2,\)"),
    ],
    ids=["unknown-name", "other-shape"],
)
def test_a_full_result_unlike_the_global_model_is_refused(params: dict, match: str) -> None:
    aggregator = NormClippingAggregator(max_norm=10.0)
    aggregator.start_round(0, lambda: {"w": torch.zeros(2)})

    with pytest.raises(ValueError, match=match):
        aggregator.accept_model(result(params), "site-1")

    aggregator.accept_model(result({"w": torch.ones(2)}), "site-1")  # the refusal left nothing behind
    assert aggregator.aggregate_model().params["w"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_update_is_refused(bad: float) -> None:
    aggregator = NormClippingAggregator(max_norm=1.0)

    with pytest.raises(ValueError, match="result of site-1: its update has NaN or infinite values; refused"):
        aggregator.accept_model(result({"w": torch.tensor([0.0, bad])}, ParamsType.DIFF), "site-1")


def test_refusals_leave_the_sum_as_it_was() -> None:
    aggregator = NormClippingAggregator(max_norm=10.0)
    aggregator.accept_model(result({"w": torch.ones(2)}, ParamsType.DIFF), "site-1")

    with pytest.raises(ValueError, match="site-1 already contributed to this round"):
        aggregator.accept_model(result({"w": torch.ones(2)}, ParamsType.DIFF), "site-1")
    with pytest.raises(ValueError, match="result of site-2 has FULL params but the accepted ones are DIFF"):
        aggregator.accept_model(result({"w": torch.ones(2)}, ParamsType.FULL), "site-2")
    with pytest.raises(ValueError, match=r"result of site-3: param 'w': shape \(3,\) and dtype torch.float32 differ"):
        aggregator.accept_model(result({"w": torch.ones(3)}, ParamsType.DIFF), "site-3")

    assert aggregator.aggregate_model().meta["nr_aggregated"] == 1


def test_lazy_refs_are_released_as_soon_as_they_are_folded_in(tmp_path: Path) -> None:
    aggregator = NormClippingAggregator(max_norm=1.0, block_bytes=8)
    refs = as_kind({"w": torch.arange(10.0)}, "lazy", tmp_path)

    aggregator.accept_model(result(refs, ParamsType.DIFF), "site-1")

    assert released(refs) and list(tmp_path.iterdir()) == []
    expected = torch.arange(10.0) / torch.linalg.vector_norm(torch.arange(10.0))
    assert torch.allclose(aggregator.aggregate_model().params["w"], expected)


def test_the_global_model_is_read_again_each_round() -> None:
    loads = []
    aggregator = NormClippingAggregator(max_norm=1.0)
    for round_ in range(2):
        aggregator.start_round(round_, lambda: loads.append(1) or {"w": torch.zeros(2)})
        for site in ("site-1", "site-2"):
            aggregator.accept_model(result({"w": torch.full((2,), 3.0)}), site)
        aggregator.aggregate_model()

    assert len(loads) == 2


def test_results_from_many_threads_sum_as_in_order() -> None:
    count = 16
    generator = torch.Generator().manual_seed(4)
    params = [{"w": torch.randn(300, generator=generator)} for _ in range(count)]
    aggregator = NormClippingAggregator(max_norm=15.0)
    barrier = threading.Barrier(count)

    def send(i: int) -> None:
        barrier.wait(timeout=10)
        aggregator.accept_model(result(params[i], ParamsType.DIFF), f"site-{i}")

    threads = [threading.Thread(target=send, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)

    expected = clipped_mean(params, [1.0] * count, 15.0, None)["w"]
    np.testing.assert_allclose(aggregator.aggregate_model().params["w"].numpy(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "max_norm", [0, -1.0, float("inf"), "1.0", True], ids=["zero", "negative", "inf", "string", "bool"]
)
def test_max_norm_must_be_a_positive_number(max_norm) -> None:
    with pytest.raises(ValueError, match=r"max_norm: expected a finite number > 0, got"):
        NormClippingAggregator(max_norm=max_norm)


def test_metrics_are_weighted_as_fedavg() -> None:
    aggregator = NormClippingAggregator(max_norm=1.0)
    aggregator.accept_model(result({"w": torch.zeros(1)}, ParamsType.DIFF, steps=1, loss=1.0), "site-1")
    aggregator.accept_model(result({"w": torch.zeros(1)}, ParamsType.DIFF, steps=3, loss=2.0), "site-2")

    assert aggregator.aggregate_model().metrics == {"loss": pytest.approx(1.75)}


def test_excluded_params_are_left_out_of_the_norm_and_the_aggregate() -> None:
    aggregator = NormClippingAggregator(max_norm=1.0, exclude_vars="big")
    aggregator.accept_model(result({"w": torch.full((1,), 0.5), "big": torch.full((1,), 1e9)}, ParamsType.DIFF), "s")

    aggregate = aggregator.aggregate_model()

    assert aggregate.params == {"w": torch.full((1,), 0.5)} and aggregate.meta["clipped"] == []
