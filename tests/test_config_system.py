"""The shared config mechanism: typed sections, one override parser, one error type."""

import dataclasses
from typing import Literal, Optional

import pytest

from scaleopt import config as C


@dataclasses.dataclass
class Inner:
  k: int = C.spec(2, min=1)


@dataclasses.dataclass
class Section:
  n: int = C.spec(3, min=1)
  x: float = 0.5
  flag: bool = True
  mode: Literal["a", "b"] = "a"
  opt: Optional[int] = None
  xs: list[float] = C.spec(default_factory=lambda: [1.0], gt=0, listify=True)
  ns: list[int] = C.spec(default_factory=lambda: [1], listify=True, distinct=True, sort=True)
  inner: Inner = dataclasses.field(default_factory=Inner)


def test_parse_converts_by_type_hint():
  s = C.parse(Section, {"n": 4.0, "x": 2, "xs": 3, "ns": [8, 2.0], "inner": {"k": 5}}, "sec")
  assert s.n == 4 and isinstance(s.n, int)
  assert s.x == 2.0 and isinstance(s.x, float)
  assert s.xs == [3.0] and s.ns == [2, 8] and s.inner == Inner(5)
  assert C.parse(Section, None, "sec") == Section()
  assert C.to_dict(s)["inner"] == {"k": 5}


@pytest.mark.parametrize("raw, msg", [
    ({"nn": 1}, "unknown key(s) sec.nn; allowed keys in sec: flag, inner, mode, n, ns, opt, x, xs"),
    ({"n": 1.5}, "sec.n = 1.5: expected an integer"),
    ({"n": True}, "sec.n = True: expected an integer"),
    ({"n": 0}, "sec.n = 0: must be an integer >= 1"),
    ({"x": "big"}, "sec.x = 'big': expected a number"),
    ({"x": float("nan")}, "sec.x = nan: expected a finite number"),
    ({"flag": 1}, "sec.flag = 1: expected true or false"),
    ({"mode": "c"}, "sec.mode = 'c': allowed values are a, b"),
    ({"opt": "x"}, "sec.opt = 'x': expected an integer"),
    ({"xs": [1.0, 0.0]}, "sec.xs = 0.0: must be > 0"),
    ({"xs": []}, "sec.xs: expected at least one value"),
    ({"ns": [4, 2, 4]}, "sec.ns = [4, 2, 4]: duplicate value(s) 4"),
    ({"inner": {"k": 0}}, "sec.inner.k = 0: must be an integer >= 1"),
    ({"inner": 3}, "sec.inner = 3: expected a mapping of keys"),
])
def test_parse_errors_name_key_value_and_allowed(raw, msg):
  with pytest.raises(C.ConfigError) as e:
    C.parse(Section, raw, "sec")
  assert str(e.value) == msg


@dataclasses.dataclass
class Switch:
  phases: Literal["auto", "on", "off"] = "auto"


def test_yaml_booleans_read_as_on_off_words():
  # ``--set run.host_phases=off`` reaches the parser as YAML 1.1's False.
  assert C.parse(Switch, C.apply_overrides({}, ["phases=off"]), "run").phases == "off"
  assert C.parse(Switch, {"phases": True}, "run").phases == "on"
  with pytest.raises(C.ConfigError, match="run.mode = True: allowed values are a, b"):
    C.parse(Section, {"mode": True}, "run")


def test_overrides_nest_parse_yaml_and_route():
  out = C.apply_overrides({"a": {"b": 1}}, ["a.c.d=1e-4", "a.b=[1, 2]", "top=x"])
  assert out == {"a": {"b": [1, 2], "c": {"d": 1e-4}}, "top": "x"}
  routed = C.apply_overrides({}, ["k=1"], route=lambda p: ["sec"] + p)
  assert routed == {"sec": {"k": 1}}
  for bad, msg in [("novalue", "expected KEY=VALUE"), ("a..b=1", "empty or malformed"),
                   ("a.b.c=1", "'b' is a value, not a section"), ("a.b=[1,", "not valid YAML")]:
    with pytest.raises(C.ConfigError, match=msg.replace("[", r"\[")):
      C.apply_overrides({"a": {"b": 1}}, [bad])
  with pytest.raises(C.ConfigError, match="must be dotted"):
    C.apply_overrides({}, ["steps=3"], min_depth=2)


def test_read_yaml_errors_are_one_line(tmp_path):
  (tmp_path / "bad.yaml").write_text("a:\n  b: [1,\n")
  for path, msg in [(tmp_path / "bad.yaml", "YAML syntax error at line 3"),
                    (tmp_path / "none.yaml", "does not exist"), (tmp_path, "is a directory")]:
    with pytest.raises(C.ConfigError) as e:
      C.read_yaml(path)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_one_error_type_for_every_config_family():
  from scaleopt.scaling import config as sweep_config
  from scaleopt.study import config as study_config
  from scaleopt.train import config as train_config
  assert (train_config.ConfigError is sweep_config.ConfigError is study_config.ConfigError
          is C.ConfigError)
