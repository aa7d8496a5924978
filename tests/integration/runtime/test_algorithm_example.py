"""The docs' "new algorithm in one module" example (``EMAFedAvg``), run as a real job, as its reader would.

The code is read from the docs, not copied here: the fenced Python block that starts with the
marker line ``# my-job/app/custom/ema_fedavg.py``, in README.md or any docs/*.md (wherever the
docs keep it). It goes into a job's ``custom/`` folder as ``ema_fedavg.py``, the server config names
``ema_fedavg.EMAFedAvg`` as the block says, and the simulator runs it with the BenchNet clients of
the runtime tests: site k adds ``k * 0.001`` to every weight with weight ``k * 100``, so FedAvg's
mean moves the model by ``D = expected_delta(2)`` a round, and the moving average by
``(1 - decay) * D``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.config import job_code_on_path, validate_job
from engine.runtime.states import JobState
from tests.integration.runtime.jobkit import expected_delta, make_bench_job

REPO = Path(__file__).resolve().parents[3]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = "# my-job/app/custom/ema_fedavg.py"
_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)

ROUNDS = 2
DECAY = 0.5
WIDTH = 16


def example_blocks() -> dict[str, list[str]]:
    """Each distinct example block -> the docs that show it."""
    blocks: dict[str, list[str]] = {}
    for doc in DOCS:
        for block in _PYTHON_BLOCK.findall(doc.read_text(encoding="utf-8")):
            if block.lstrip().startswith(MARKER):
                blocks.setdefault(block, []).append(doc.relative_to(REPO).as_posix())
    return blocks


BLOCKS = example_blocks()


def test_the_docs_show_the_example() -> None:
    assert BLOCKS, f"no ```python block starting with {MARKER!r} in README.md or docs/*.md"


@pytest.mark.parametrize("block", list(BLOCKS), ids=[",".join(docs) for docs in BLOCKS.values()])
def test_the_ema_fedavg_example_runs_as_a_job_and_moves_the_model_by_its_formula(
    simulate, tmp_path: Path, block: str
) -> None:
    first_line = block.lstrip().splitlines()[0]
    assert "path = ema_fedavg.EMAFedAvg" in first_line  # what the server config below names
    job = make_bench_job(tmp_path, num_rounds=ROUNDS, num_clients=2, layers=2, width=WIDTH, chunk_bytes=4096)
    custom = job / "app" / "custom"
    (custom / "ema_fedavg.py").write_text(block, encoding="utf-8")
    server = job / "app" / "config" / "config_fed_server.conf"
    text = server.read_text(encoding="utf-8")
    workflow = next(line for line in text.splitlines() if line.startswith("workflows = "))
    ema = f"workflows = [{{ id = ema, path = ema_fedavg.EMAFedAvg, args {{ num_clients = 2, num_rounds = {ROUNDS}, decay = {DECAY} }} }}]"
    server.write_text(text.replace(workflow, ema), encoding="utf-8")
    with job_code_on_path(custom):
        from benchnet_model import BenchNet

        initial = {name: t.detach().clone() for name, t in BenchNet(layers=2, width=WIDTH).state_dict().items()}

    assert validate_job(job) == []
    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    final = load_file(tmp_path / "workspace" / "server" / "models" / "global.safetensors")
    assert final.keys() == initial.keys()
    moved = ROUNDS * (1 - DECAY) * expected_delta(2)  # FedAvg alone would move it by ROUNDS * D
    for name, tensor in initial.items():
        assert torch.allclose(final[name].double(), tensor.double() + moved, rtol=0, atol=1e-6), name
