"""Fixtures of the robustness tests: the simulator fixture of the runtime tests."""

from tests.integration.runtime.conftest import simulate  # noqa: F401 - a fixture
