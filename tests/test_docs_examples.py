"""The shipped config example lists every SelZeroConfig field with its default (the
configuration page's table: tests/test_docs.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from selzero_plugin import SelZeroConfig

ROOT = Path(__file__).resolve().parents[1]
FIELDS = [f.name for f in dataclasses.fields(SelZeroConfig)]


def test_example_config_lists_every_field_with_its_default():
    raw = yaml.safe_load((ROOT / "configs" / "selzero.yaml").read_text())
    assert list(raw) == FIELDS
    loaded = SelZeroConfig.from_file(ROOT / "configs" / "selzero.yaml")
    defaults = SelZeroConfig(params=list(loaded.params))
    assert loaded == defaults
