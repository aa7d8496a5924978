"""``flengine report`` on a real Swarm run with cross-site evaluation: the matrix becomes a heat map."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.integration.runtime.conftest import read_json

JOBS = Path(__file__).resolve().parents[3] / "jobs"


def test_report_of_a_swarm_run_draws_its_cross_site_matrix(simulate, tmp_path: Path) -> None:
    job = shutil.copytree(JOBS / "swarm", tmp_path / "swarm")
    config = job / "app" / "config" / "config_fed_server.conf"
    config.write_text(config.read_text(encoding="utf-8").replace("num_rounds = 3", "num_rounds = 2"), encoding="utf-8")
    result, output = simulate(job)
    assert result.exit_code == 0, output
    matrix = read_json(result.workspace / "summary.json")["cross_site_val"]
    cells = sum(isinstance(cell, dict) and "accuracy" in cell for row in matrix.values() for cell in row.values())

    done = subprocess.run(
        [sys.executable, "-m", "engine", "report", str(result.workspace), "--format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    sections = {section["id"]: section for section in document["sections"]}
    assert sections["cross-site"]["plotted"] and sections["cross-site"]["series"] == {"accuracy": cells}
    assert cells == 3 * 4  # 3 sites evaluate the global model and the 3 local ones
    assert sections["global-metrics"]["series"] == {"global_accuracy": 2, "local_accuracy": 2}
    assert set(sections["memory"]["series"]) == {"server", "site-1", "site-2", "site-3"}
    assert not sections["round-times"]["plotted"] or "sending" not in sections["round-times"]["series"]
    assert (result.workspace / "report.html").is_file()
