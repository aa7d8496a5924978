"""KrumAggregator against brute-force Krum scores computed with numpy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.aggregators import KrumAggregator
from engine.model import MetaKey, ParamsType

from .test_robust_kept import TINY_BLOCK_BYTES, as_kind, result

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
KINDS = ["tensor", "numpy", "lazy", "lazy-numpy"]
TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}


def client_params(count: int, dtype: torch.dtype, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        {
            "w": (torch.randn(5, 7, generator=generator) * (1 + i)).to(dtype),
            "b": torch.randn(4, generator=generator).to(dtype),
            "bn.num_batches_tracked": torch.randint(0, 100, (), generator=generator),
        }
        for i in range(count)
    ]


def brute_force_krum(params: list[dict[str, torch.Tensor]], names: list[str], f: int) -> np.ndarray:
    """Each result's Krum score from flattened float64 vectors and every pairwise distance."""
    vectors = [
        np.concatenate([p[name].double().numpy().ravel() for name in names if p[name].is_floating_point()])
        for p in params
    ]
    count = len(vectors)
    distances = np.array([[np.sum((vectors[i] - vectors[j]) ** 2) for j in range(count)] for i in range(count)])
    return np.array([np.sort(np.delete(distances[i], i))[: count - f - 2].sum() for i in range(count)])


def combinations():
    for kind in KINDS:
        for name, dtype in DTYPES.items():
            if not (dtype is torch.bfloat16 and "numpy" in kind):
                yield pytest.param(kind, dtype, id=f"{kind}-{name}")


@pytest.mark.parametrize(
    ("count", "f", "selected"),
    [(5, 1, 1), (6, 1, 3), (7, 2, 2), (4, 0, 2)],
    ids=["5-f1-m1", "6-f1-m3", "7-f2-m2", "4-f0-m2"],
)
@pytest.mark.parametrize(("kind", "dtype"), list(combinations()))
def test_krum_selects_the_lowest_brute_force_scores_and_averages_them(
    kind: str, dtype: torch.dtype, count: int, f: int, selected: int, tmp_path: Path
) -> None:
    params = client_params(count, dtype, seed=count)
    steps = [1 + i % 3 for i in range(count)]
    aggregator = KrumAggregator(num_byzantine=f, num_selected=selected, block_bytes=TINY_BLOCK_BYTES)
    for i, values in enumerate(params):
        aggregator.accept_model(result(as_kind(values, kind, tmp_path), steps=steps[i]), f"site-{i}")

    aggregate = aggregator.aggregate_model()

    scores = brute_force_krum(params, list(params[0]), f)
    chosen = [int(i) for i in np.argsort(scores, kind="stable")[:selected]]
    assert aggregate.meta["selected"] == [f"site-{i}" for i in chosen]
    assert aggregate.meta["krum_scores"] == pytest.approx({f"site-{i}": s for i, s in enumerate(scores)}, rel=1e-4)
    weights = np.array([steps[i] for i in chosen], dtype=np.float64) / sum(steps[i] for i in chosen)
    for name, first in params[0].items():
        expected = sum(w * params[i][name].double().numpy() for w, i in zip(weights, chosen, strict=True))
        value = torch.as_tensor(aggregate.params[name])
        assert isinstance(aggregate.params[name], np.ndarray) is ("numpy" in kind)
        assert value.dtype == first.dtype and value.shape == first.shape
        if first.is_floating_point():
            np.testing.assert_allclose(value.double().numpy(), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
        else:
            assert value.item() == round(float(expected))


@pytest.mark.parametrize("params_type", [ParamsType.FULL, ParamsType.DIFF], ids=["full", "diff"])
def test_krum_with_one_selected_returns_that_result_exactly(params_type: ParamsType) -> None:
    params = client_params(5, torch.float32)
    aggregator = KrumAggregator(num_byzantine=1)
    for i, values in enumerate(params):
        aggregator.accept_model(result(values, params_type, steps=3), f"site-{i}")

    aggregate = aggregator.aggregate_model()

    index = int(aggregate.meta["selected"][0].removeprefix("site-"))
    assert aggregate.params_type is params_type
    assert all(torch.equal(aggregate.params[name], params[index][name]) for name in params[index])


ATTACKS = {
    "scaled": lambda x: x * 1e6,
    "sign-flip": lambda x: -x * 3,
    "huge-constant": lambda x: torch.full_like(x, 1e30),
    "nan": lambda x: torch.full_like(x, float("nan")),
}


@pytest.mark.parametrize("selected", [1, 3], ids=["krum", "multi-krum"])
@pytest.mark.parametrize("attack", ATTACKS.values(), ids=ATTACKS.keys())
def test_a_byzantine_result_far_from_the_others_is_never_selected(attack, selected: int, tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(5)
    center = torch.randn(100, generator=generator)
    honest = [{"w": center + 0.1 * torch.randn(100, generator=generator)} for _ in range(5)]
    aggregator = KrumAggregator(num_byzantine=1, num_selected=selected, block_bytes=64)
    for i, params in enumerate([*honest, {"w": attack(center)}]):
        aggregator.accept_model(result(as_kind(params, "lazy", tmp_path)), f"site-{i}")

    aggregate = aggregator.aggregate_model()

    assert "site-5" not in aggregate.meta["selected"] and len(aggregate.meta["selected"]) == selected
    assert aggregate.meta["krum_scores"]["site-5"] == float("inf") or aggregate.meta["krum_scores"]["site-5"] > 100
    lowest, highest = torch.stack([p["w"] for p in honest]).aminmax(dim=0)
    assert bool(((aggregate.params["w"] >= lowest) & (aggregate.params["w"] <= highest)).all())


@pytest.mark.parametrize(
    ("f", "selected", "count", "assumed_f", "assumed_selected"),
    [(1, 1, 4, 0, 1), (2, 1, 6, 1, 1), (1, 5, 5, 1, 4), (1, 3, 2, 0, 2), (2, 2, 1, 0, 1)],
    ids=["2f+3", "2f+3-f2", "f+selected", "two-left", "one-left"],
)
def test_with_too_few_results_krum_assumes_the_byzantine_sites_that_fit_and_goes_on(
    f: int, selected: int, count: int, assumed_f: int, assumed_selected: int
) -> None:
    # Fewer results than 2f + 3 happen when results are refused (each a liar left out already)
    # or sites die: failing the round would let one refused liar stop the job.
    aggregator = KrumAggregator(num_byzantine=f, num_selected=selected)
    values = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5][:count]
    for i, value in enumerate(values):
        aggregator.accept_model(result({"w": torch.full((2,), value)}), f"site-{i}")

    aggregate = aggregator.aggregate_model()

    assert aggregate.meta["num_byzantine"] == assumed_f
    assert len(aggregate.meta["selected"]) == assumed_selected
    assert aggregate.meta["nr_aggregated"] == count


def test_the_selected_results_metrics_are_their_weighted_mean() -> None:
    aggregator = KrumAggregator(num_byzantine=0, num_selected=2, aggregation_weights={"site-1": 3.0})
    values = [0.0, 0.1, 0.2, 50.0]
    for i, value in enumerate(values):
        aggregator.accept_model(result({"w": torch.full((3,), value)}, steps=1, accuracy=value), f"site-{i}")

    aggregate = aggregator.aggregate_model()

    assert aggregate.meta["selected"] == ["site-1", "site-0"]  # site-1 sits between the other two
    assert aggregate.metrics == pytest.approx({"accuracy": (0.1 * 3 + 0.0) / 4})
    assert aggregate.params["w"].tolist() == pytest.approx([0.075] * 3)


def test_a_weight_above_max_local_steps_is_refused() -> None:
    aggregator = KrumAggregator(num_byzantine=0, max_local_steps=10)

    with pytest.raises(ValueError, match="above the aggregator's max_local_steps = 10"):
        aggregator.accept_model(result({"w": torch.zeros(1)}, steps=11), "site-1")


def test_integer_only_results_tie_and_are_ranked_by_name() -> None:
    aggregator = KrumAggregator(num_byzantine=0)
    for name in ("site-c", "site-a", "site-b"):
        aggregator.accept_model(result({"n": torch.tensor(7)}, steps=None), name)

    aggregate = aggregator.aggregate_model()

    assert aggregate.meta["selected"] == ["site-a"] and aggregate.params["n"].item() == 7
    assert MetaKey.NUM_STEPS_CURRENT_ROUND not in aggregate.meta
