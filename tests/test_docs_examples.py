"""The shipped config example and the README's reference cover every SelZeroConfig field."""

from __future__ import annotations

import dataclasses
import re
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


def test_readme_config_reference_lists_every_field():
    readme = (ROOT / "README.md").read_text()
    documented = re.findall(r"^\| `(\w+)` \|", readme, re.M)
    assert [f for f in documented if f in FIELDS] == FIELDS
