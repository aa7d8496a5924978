"""`flare.client_state()`: what a script keeps for its site across rounds, and SCAFFOLD's c_i kept there."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from engine import client as flare
from engine.client import ClientAPIError, ClientState, ScaffoldClient, TaskExchange
from engine.client.backends import InProcessBackend, install_backend
from engine.client.scaffold import C_LOCAL_STATE
from engine.model import FLModel
from engine.model.scaffold_keys import C_GLOBAL_KEY


@pytest.fixture
def site_state(tmp_path: Path) -> Iterator[Path]:
    """A Client API backend for site-1 whose state folder is ``tmp_path/state``."""
    install_backend(InProcessBackend(TaskExchange(), "site-1", "job-1", state_dir=tmp_path / "state"))
    yield tmp_path / "state"
    install_backend(None)


def test_values_and_tensors_survive_a_new_state_object(site_state: Path) -> None:
    state = flare.client_state()
    assert state.load("rounds", 0) == 0 and state.load_tensors("c") is None  # nothing yet

    state.save("rounds", {"seen": [1, 2]})
    state.save_tensors("c", {"w": torch.arange(3.0)})

    again = flare.client_state()  # the next task's fresh run of the script
    assert again.load("rounds") == {"seen": [1, 2]}
    assert torch.equal(again.load_tensors("c")["w"], torch.arange(3.0))
    assert sorted(os.listdir(site_state)) == ["c.safetensors", "rounds.json"]  # no temporary left


@pytest.mark.parametrize("name", ["../escape", "a/b", "", "x" * 65, ".hidden", "päth"])
def test_a_name_that_is_not_a_plain_word_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ClientAPIError, match="not a state name"):
        ClientState(tmp_path).save(name, 1)
    assert not any(tmp_path.iterdir())


def test_a_value_json_cannot_hold_and_a_corrupt_file_are_clear_errors(tmp_path: Path) -> None:
    state = ClientState(tmp_path)
    with pytest.raises(ClientAPIError, match="not a JSON value"):
        state.save("model", torch.zeros(2))
    (tmp_path / "broken.json").write_text("{", encoding="utf-8")
    (tmp_path / "torn.safetensors").write_bytes(b"\x00" * 5)
    with pytest.raises(ClientAPIError, match="broken.json is not JSON"):
        state.load("broken")
    with pytest.raises(ClientAPIError, match="torn.safetensors is not a safetensors file"):
        state.load_tensors("torn")


def test_outside_a_job_there_is_no_state(tmp_path: Path) -> None:
    install_backend(InProcessBackend(TaskExchange(), "site-1", "job-1"))
    try:
        with pytest.raises(ClientAPIError, match="keeps no state"):
            flare.client_state()
    finally:
        install_backend(None)


def _one_round(net: nn.Linear, scaffold: ScaffoldClient, c_global: torch.Tensor) -> dict:
    scaffold.begin_round(FLModel(params={}, meta={C_GLOBAL_KEY: {"weight": c_global}}))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    optimizer.zero_grad()
    (net(torch.ones(1, 2)) ** 2).sum().backward()
    optimizer.step()
    scaffold.correct(0.1)
    return scaffold.end_round()


def test_scaffold_keeps_c_i_in_the_site_state_across_fresh_runs_of_the_script(site_state: Path) -> None:
    torch.manual_seed(0)
    kept = nn.Linear(2, 1, bias=False)
    fresh = nn.Linear(2, 1, bias=False)
    fresh.load_state_dict(kept.state_dict())
    c_global = torch.full((1, 2), 0.5)
    in_memory = ScaffoldClient(kept, state=ClientState(site_state.parent / "other"))  # one run, two rounds

    for round_ in range(2):
        expected = _one_round(kept, in_memory, c_global)
        got = _one_round(fresh, ScaffoldClient(fresh), c_global)  # a new script run each round (default state)
        assert torch.allclose(got["scaffold_c_delta"]["weight"], expected["scaffold_c_delta"]["weight"]), round_
    assert (site_state / f"{C_LOCAL_STATE}.safetensors").is_file()


def test_a_saved_c_i_that_does_not_fit_the_model_is_refused(site_state: Path) -> None:
    ClientState(site_state).save_tensors(C_LOCAL_STATE, {"weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="scaffold_c_local of the site's saved state: 'weight' has shape"):
        ScaffoldClient(nn.Linear(2, 1, bias=False))
