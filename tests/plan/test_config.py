"""Config: one frozen, validated object from keywords, TOML or both; typed errors name the key."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import autoshard
from autoshard import Config, ConfigError, HardwareError, MeshError


def test_defaults_are_documented_values():
    c = Config(mesh={"data": 8})
    assert c.hardware is None and c.schedule == "1f1b" and c.profile == "model" and c.donate
    assert c.mesh.axes == (("data", 8),) and c.pipeline is None and c.search.memory_budget is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.schedule = "gpipe"   # type: ignore[misc]


def test_toml_then_keywords(tmp_path):
    path = tmp_path / "autoshard.toml"
    path.write_text('hardware = "h100-sxm"\nmemory_budget = 4e9\n[mesh]\ndata = 2\nmodel = 4\n'
                    '[options]\nstorage_modes = ["replicated"]\n')
    c = Config.make(path, hardware="a100-sxm")
    assert c.hardware.name == "a100-sxm" and c.mesh.to_dict() == {"data": 2, "model": 4}
    assert c.search.storage_modes == ("replicated",) and c.search.memory_budget == 4e9
    assert Config.make(c, mesh={"data": 8}).mesh.to_dict() == {"data": 8}


@pytest.mark.parametrize("kw, error, match", [
    ({"mesh": {"data": 0}}, MeshError, "size 0"),
    ({"mesh": {"data": 8}, "hardware": "tpu9"}, HardwareError, "tpu9"),
    ({"mesh": {"data": 8}, "memory_budget": -1}, ConfigError, "memory_budget=-1"),
    ({"mesh": {"data": 8}, "pipeline": "alpa"}, ConfigError, "pipeline='alpa' is unknown"),
    ({"mesh": {"data": 8}, "pipeline": "rannc", "schedule": "zb-v"}, ConfigError, "schedule='zb-v'"),
    ({"mesh": {"data": 8}, "pipeline": "rannc", "profile": "guess"}, ConfigError, "profile='guess'"),
    ({"mesh": {"data": 8}, "pipeline": "rannc", "pipeline_options": {"blocks": 4}}, ConfigError, "blocks"),
    ({"mesh": {"pipe": 2, "data": 4}, "pipeline": "graphpipe"}, ConfigError, "'pipe' axis"),
    ({"mesh": {"data": 8}, "num_microbatches": 4}, ConfigError, "pipeline plans only"),
    ({"mesh": {"data": 8}, "search": {"max_plan": 3}}, ConfigError, "max_plan"),
    ({"mesh": {"data": 8}, "cache": "/tmp"}, ConfigError, "unknown key"),
])
def test_invalid_settings_are_typed_errors(kw, error, match):
    with pytest.raises(error, match=match):
        Config.make(**kw)


def test_unknown_toml_keys_are_errors(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[mesh]\ndata = 8\n[meshes]\nx = 1\n")
    with pytest.raises(ConfigError, match="meshes"):
        Config.make(path)
    with pytest.raises(ConfigError, match="does not exist"):
        Config.make(tmp_path / "missing.toml")


def test_decorator_and_plan_take_the_same_config():
    step = autoshard.autoshard(lambda x: x, config=Config(mesh={"data": 8}, donate=False))
    assert step.config.mesh.to_dict() == {"data": 8} and not step.config.donate
    with pytest.raises(ConfigError, match="no mesh"):
        autoshard.autoshard(lambda x: x)


def test_readme_toml_examples_are_valid_configs(tmp_path):
    """Every ```toml block of the README and docs/ loads as a Config (the docs cannot drift from the keys)."""
    root = Path(__file__).resolve().parents[2]
    text = "".join(p.read_text() for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))])
    blocks = re.findall(r"```toml\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 2
    for i, text in enumerate(blocks):
        f = tmp_path / f"example{i}.toml"
        f.write_text(text)
        cfg = autoshard.Config.make(f)
        assert cfg.mesh is not None and cfg.hardware is not None and cfg.hardware.name == "h100-sxm"
