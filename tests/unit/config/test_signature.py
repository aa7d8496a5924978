"""Checking args against a signature whose ``**kwargs`` go up to the parent class (`engine.config.signature`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import ComponentSpec, ConfigDocument, check_component, job_code_on_path
from engine.config.build import resolve_dotted_path
from engine.config.signature import accepted_args

DOC = ConfigDocument(Path("c.conf"), "c.conf", {}, {("components", 0): 7})
WHERE = "c.conf:7: components[0].args"

JOB_CODE = """
class Base:
    def __init__(self, num_rounds: int = 5, lr: float = 0.1, *, width: int) -> None:
        self.num_rounds, self.lr, self.width = num_rounds, lr, width


class Child(Base):
    def __init__(self, momentum: float = 0.9, **kwargs) -> None:
        super().__init__(**kwargs)
        self.momentum = momentum


class GrandChild(Child):
    def __init__(self, extra: int = 1, **more) -> None:
        super().__init__(**more)


class Inherits(Child):
    pass


class FixesLr(Base):
    def __init__(self, **kwargs) -> None:
        super().__init__(lr=0.5, **kwargs)


class FixesFirstPositionally(Base):
    def __init__(self, **kwargs) -> None:
        super().__init__(3, **kwargs)


class ReadsItsKwargs(Base):
    def __init__(self, **kwargs) -> None:
        self.color = kwargs.pop("color", "blue")
        super().__init__(**kwargs)


class KeepsItsKwargs:
    def __init__(self, a: int = 1, **options) -> None:
        self.options = options


class PassesToObject:
    def __init__(self, a: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)


def factory(a: int = 1, **kwargs):
    return kwargs
"""


@pytest.fixture(autouse=True)
def job_code(tmp_path: Path):
    custom = tmp_path / "custom"
    custom.mkdir()
    (custom / "kw.py").write_text(JOB_CODE, encoding="utf-8")
    with job_code_on_path(custom):
        yield


def problems(path: str, **args: object) -> list[str]:
    return [str(p) for p in check_component(ComponentSpec(path, args, "c", ("components", 0)), DOC)]


@pytest.mark.parametrize(
    ("path", "names", "takes_any"),
    [
        ("kw.Child", ["momentum", "num_rounds", "lr", "width"], False),
        ("kw.GrandChild", ["extra", "momentum", "num_rounds", "lr", "width"], False),
        ("kw.Inherits", ["momentum", "num_rounds", "lr", "width"], False),
        ("kw.FixesLr", ["num_rounds", "width"], False),
        ("kw.FixesFirstPositionally", ["lr", "width"], False),
        ("kw.ReadsItsKwargs", [], True),  # nothing known to go up: as before, any name
        ("kw.KeepsItsKwargs", ["a"], True),
        ("kw.PassesToObject", ["a"], False),
        ("kw.factory", ["a"], True),
    ],
    ids=[
        "child",
        "two-levels",
        "no-init-of-its-own",
        "arg-the-child-passes-itself",
        "arg-the-child-passes-by-position",
        "kwargs-read-before-passing",
        "kwargs-kept",
        "kwargs-to-object",
        "factory-function",
    ],
)
def test_accepted_args_follow_kwargs_up_the_mro(path: str, names: list[str], takes_any: bool) -> None:
    accepted = accepted_args(resolve_dotted_path(path))

    assert accepted is not None
    assert list(accepted.parameters) == names
    assert accepted.takes_any is takes_any


@pytest.mark.parametrize(
    ("path", "args", "expected"),
    [
        ("kw.Child", {"width": 2, "num_rounds": 3, "momentum": 0.5}, []),
        (
            "kw.Child",
            {"width": 2, "num_round": 3},
            [
                f"{WHERE}.num_round: unknown arg 'num_round' for kw.Child "
                "(did you mean 'num_rounds'? accepted: momentum, num_rounds, lr, width)"
            ],
        ),
        ("kw.Child", {"width": 2, "num_rounds": "five"}, [f'{WHERE}.num_rounds: expected an integer, got "five"']),
        ("kw.GrandChild", {}, [f"{WHERE}.width: missing required arg 'width' for kw.GrandChild"]),
        (
            "kw.FixesLr",
            {"width": 2, "lr": 0.2},
            [f"{WHERE}.lr: unknown arg 'lr' for kw.FixesLr (accepted: num_rounds, width)"],
        ),
        ("kw.ReadsItsKwargs", {"width": 2, "color": "red"}, []),
        (
            "kw.PassesToObject",
            {"b": 2},
            [f"{WHERE}.b: unknown arg 'b' for kw.PassesToObject (accepted: a)"],
        ),
    ],
    ids=[
        "valid",
        "typo-in-a-parents-arg",
        "wrong-type-of-a-parents-arg",
        "parents-required-arg-missing",
        "arg-the-child-sets-itself",
        "kwargs-read-take-any-name",
        "kwargs-to-object-take-none",
    ],
)
def test_config_args_are_checked_against_the_parents_signature(path: str, args: dict, expected: list[str]) -> None:
    assert problems(path, **args) == expected


def test_fedopt_takes_fedavgs_args_through_kwargs_and_a_typo_still_gets_a_suggestion() -> None:
    assert problems("engine.workflows.FedOpt", num_rounds=3, min_clients=2, server_optimizer="yogi") == []

    (typo,) = problems("engine.workflows.FedOpt", num_round=3)
    (wrong_type,) = problems("engine.workflows.FedOpt", sample_seed="seven")

    assert typo.startswith(
        f"{WHERE}.num_round: unknown arg 'num_round' for engine.workflows.FedOpt (did you mean 'num_rounds'?"
    )
    assert "server_optimizer" in typo and "site_wait_timeout" in typo  # its own args and FedAvg's are listed
    assert wrong_type == f'{WHERE}.sample_seed: expected an integer or null, got "seven"'
