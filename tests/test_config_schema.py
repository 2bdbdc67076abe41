"""Typed config groups (mptex.config_schema): one validator per kind of value, each error one
line naming the key, the value and what was expected; every group's dataclass is an OmegaConf
structured config whose defaults are the shipped YAML's."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from mptex._paths import CONFIG_DIR, EXPERIMENTS_DIR
from mptex.bake.unwrap import PackDefaults
from mptex.config_schema import (
    REQUIRED,
    SEED,
    AnyOf,
    ConfigError,
    FilePath,
    Flag,
    Integer,
    ListOf,
    Name,
    Number,
    OneOf,
    OrNull,
    Table,
    Text,
    check_group,
    defaults_of,
    setting,
)
from mptex.export_config import EXPORT_DEFAULTS, ExportConfig
from mptex.scenes.config import SCENE_DEFAULTS, SCENE_SCHEMAS
from mptex.search.config import SEARCH_DEFAULTS, SearchConfig
from mptex.texture import GridConfig, TextureConfig
from mptex.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = [TrainConfig, ExportConfig, SearchConfig, TextureConfig, GridConfig, PackDefaults,
           *dict.fromkeys(SCENE_SCHEMAS.values())]  # fmt: skip


@pytest.mark.parametrize(
    "check, good, bad, expected",
    [
        (Integer(min=0), [0, 7], [-1, 1.0, True, "3"], "an integer >= 0"),
        (Integer(1, 16), [1, 16], [0, 17], "an integer in [1, 16]"),
        (SEED, [0, 2**63 - 2], [-1, 2**63 - 1], "an integer in [0, 2**63 - 1)"),
        (Number(min=0, min_open=True), [1e-9, 3], [0, float("inf"), float("nan"), False],
         "a finite number > 0"),
        (Number(0, 1, max_open=True), [0, 0.5], [1, -0.1], "a number in [0, 1)"),
        (Flag(), [True, False], ["no", 0], "true or false"),
        (OneOf(["a", "b"]), ["a"], ["c", None], "one of ['a', 'b']"),
        (OneOf([True]), [True], [1], "one of [True]"),
        (Text(), ["", "x"], [3, None], "a string"),
        (FilePath(), ["x.obj"], ["", None], "a file or folder path"),
        (Name(), ["tiny_search"], ["a/b", "1a", 3], "a name of letters, digits and _"),
        (ListOf(Integer(), length=2), [[1, 2], (3, 4)], [[1], [1, "2"], "12"],
         "a list of 2 values, each an integer"),
        (ListOf(Text(), non_empty=True), [["a"]], [[]],
         "a non-empty list of values, each a string"),
        (Table(), [{}, {"k": 1}], [[], "x"], "a mapping"),
        (OrNull(Integer(min=1), "the default"), [None, 2], [0],
         "null (the default) or an integer >= 1"),
        (AnyOf(Flag(), FilePath()), [True, "p"], ["", 1], "true or false or a file or folder path"),
    ],
)  # fmt: skip
def test_each_kind_of_value_accepts_and_refuses_in_one_line(check, good, bad, expected):
    assert check.what == expected
    for value in good:
        check(value, "group.key")
    for value in bad:
        with pytest.raises(ConfigError) as info:
            check(value, "group.key")
        assert str(info.value) == f"group.key: expected {expected}, got {value!r}"


def test_normalising_kinds_return_the_normal_form():
    assert ListOf(OneOf(["obj", "glb"]), unique=True, comma_text=True)("glb, obj,glb", "k") == [
        "glb",
        "obj",
    ]
    assert ListOf(Integer())((1, 2), "k") == [1, 2]
    assert Integer(min=0, note="0: off").what == "an integer >= 0 (0: off)"
    assert Text(what="auto or a device").what == "auto or a device"


@dataclasses.dataclass
class _Inner:
    size: int = dataclasses.field(default=1, metadata={"check": Integer(min=1)})


@dataclasses.dataclass
class _Outer:
    name: str = REQUIRED
    low: float = 0.0
    high: float = setting(1.0, rule=lambda s: None if s["high"] > s["low"] else "more than low")
    tags: list[str] = setting(["a"])
    inner: _Inner = dataclasses.field(default_factory=_Inner)
    limit: int | None = None


def test_a_group_checks_keys_required_values_types_nesting_and_relations():
    ok = check_group(_Outer, {"name": "x", "inner": None}, "g")
    assert ok == {"name": "x", "low": 0.0, "high": 1.0, "tags": ["a"], "inner": {"size": 1},
                  "limit": None}  # fmt: skip
    cases = [
        ({"name": "x", "hgih": 2}, "g.hgih: unknown key; valid keys: ['high', 'inner', 'limit', "
         "'low', 'name', 'tags']"),
        ({}, "g.name: required, not set"),
        ({"name": 3}, "g.name: expected a string, got 3"),  # from the annotation: str
        ({"name": "x", "tags": ["a", 1]}, "g.tags: expected a list of values, each a string, "
         "got ['a', 1]"),
        ({"name": "x", "limit": 1.5}, "g.limit: expected null or an integer, got 1.5"),
        ({"name": "x", "inner": {"size": 0}}, "g.inner.size: expected an integer >= 1, got 0"),
        ({"name": "x", "inner": {"sise": 2}}, "g.inner.sise: unknown key; valid keys: ['size']"),
        ({"name": "x", "high": -1}, "g.high: expected more than low, got -1"),
    ]  # fmt: skip
    for values, message in cases:
        with pytest.raises(ConfigError) as info:
            check_group(_Outer, values, "g")
        assert str(info.value) == message


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: s.__name__)
def test_every_group_is_a_structured_config_whose_defaults_pass_its_check(schema):
    node = OmegaConf.structured(schema)
    assert set(node) == {f.name for f in dataclasses.fields(schema)}
    defaults = defaults_of(schema)
    if REQUIRED not in defaults.values():
        assert check_group(schema, {}, "group") == check_group(schema, defaults, "group")


def test_the_shipped_yaml_is_the_schemas_defaults():
    def load(path):
        return yaml.safe_load(path.read_text())

    assert load(CONFIG_DIR / "export" / "default.yaml") == EXPORT_DEFAULTS
    for name in ("builtin", "mesh", "nerf"):
        assert load(CONFIG_DIR / "scene" / f"{name}.yaml") == SCENE_DEFAULTS[name]
    search = load(EXPERIMENTS_DIR / "precision_search.yaml")["search"]
    assert set(search) == set(SEARCH_DEFAULTS)
    assert set(search["space"]) == set(SEARCH_DEFAULTS["space"])
    assert set(search["cost"]) == set(SEARCH_DEFAULTS["cost"])
    for texture in (CONFIG_DIR / "texture").glob("*.yaml"):
        assert set(load(texture)) == set(defaults_of(TextureConfig))


def test_training_checks_the_export_group_without_importing_the_bake():
    code = ("import sys, mptex.train.config as c; c.validate_config; "
            "print(sorted(m for m in sys.modules if m.startswith('mptex.bake')))")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env, cwd=ROOT)  # fmt: skip
    assert out.stdout.strip() == "[]"


def test_an_integer_without_a_bound_of_its_own_stays_within_64_bits():
    # Counts and sizes become torch sizes: 2**63 overflowed torch's int64 mid-start.
    assert Integer(min=1)(2**63 - 1, "k") == 2**63 - 1
    assert Integer(max=0)(-(2**63), "k") == -(2**63)
    with pytest.raises(ConfigError) as info:
        Integer(min=1)(2**63, "texture.internal_dims")
    assert str(info.value) == (
        "texture.internal_dims: expected an integer >= 1 and within a 64-bit integer's range "
        "(|value| < 2**63), got 9223372036854775808"
    )
    with pytest.raises(ConfigError, match=r"^k: expected an integer <= 0 and within"):
        Integer(max=0)(-(2**63) - 1, "k")
    # A bound of its own decides (a generator's seed takes 64 unsigned bits).
    assert Integer(0, 2**64, max_open=True)(2**63, "k") == 2**63
    with pytest.raises(ConfigError, match=r"^k: expected an integer >= 1, got 0$"):
        Integer(min=1)(0, "k")
