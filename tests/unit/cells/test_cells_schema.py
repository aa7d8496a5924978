"""The config schemas' ``cell { ... }`` object and `CellSettings` agree key for key, default for default."""

from __future__ import annotations

import dataclasses

import pytest

from engine.cells import CellSettings
from engine.config.schema import load_schema, top_level_defaults
from engine.site import cell_settings_of
from engine.site.endpoint import INSECURE_KEY


def cell_schema() -> dict:
    return load_schema("common")["$defs"]["cell"]


def test_schema_keys_are_the_settings_fields_and_the_insecure_switch() -> None:
    fields = {field.name for field in dataclasses.fields(CellSettings)}

    assert set(cell_schema()["properties"]) == fields | {INSECURE_KEY}


def test_schema_defaults_are_the_settings_defaults_and_secure() -> None:
    defaults = {name: prop["default"] for name, prop in cell_schema()["properties"].items()}

    assert cell_settings_of({"cell": defaults}) == CellSettings()
    assert defaults[INSECURE_KEY] is False


@pytest.mark.parametrize("side", ["config_fed_server", "config_fed_client"])
def test_both_configs_accept_a_cell_object(side: str) -> None:
    assert top_level_defaults(side)["cell"] == {}
