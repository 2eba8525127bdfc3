"""Hypothesis fuzz of the config loader: random YAML text, valid YAML with wrong types, unknown
keys and missing sections, random overrides, include cycles and missing include files. Every
case either loads or ends in a :class:`ConfigError` that names the field or the file; nothing
else (a traceback from deep inside) may escape."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lm_pipeline.config import RunConfig, load_config
from lm_pipeline.schema import ConfigError, ConfigProblems, to_dict

DEFAULTS = to_dict(RunConfig())
FULL = os.environ.get("LM_PIPELINE_FUZZ_EXAMPLES")  # the faults tier runs more examples
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
TALLY: dict[str, dict[str, int]] = {}


def _paths(node, prefix=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield (*prefix, k)
            yield from _paths(v, (*prefix, k))


PATHS = sorted(_paths(DEFAULTS), key=str)

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                    st.sampled_from(["gpt2", "llama", "bpe", "hf", "auto", "10m", "1e-3", "-1", "", "..", "nan"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=6)


def _check(load, kind: str) -> None:
    """``load()`` returns a RunConfig or raises a ConfigError with a message; count the outcome."""
    tally = TALLY.setdefault(kind, {"cases": 0, "loaded": 0, "config_error": 0})
    tally["cases"] += 1
    try:
        cfg = load()
    except ConfigError as e:
        for problem in e.problems if isinstance(e, ConfigProblems) else (e,):  # all of a config's at once
            assert str(problem).startswith("config"), str(problem)
            assert problem.message.strip(), "an empty error message"
        tally["config_error"] += 1
        return
    assert isinstance(cfg, RunConfig)
    tally["loaded"] += 1


def _write(tmp: Path, text: str) -> Path:
    p = tmp / f"c{abs(hash(text)) % 10**9}.yaml"
    p.write_text(text, encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def tmpdir_module(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@settings(max_examples=int(FULL or 150), **SETTINGS)
@given(text=st.one_of(st.text(max_size=200),
                      st.text(alphabet=st.sampled_from(list("{}[]:,-!&*?|>'\"%@` \n\t#abc12")), max_size=120)))
def _fuzz_yaml_text(tmpdir_module, text):
    _check(lambda: load_config(_write(tmpdir_module, text)), "random YAML text")


@settings(max_examples=int(FULL or 150), **SETTINGS)
@given(edits=st.lists(st.tuples(st.sampled_from(PATHS), st.one_of(values, st.just("<delete>"))), min_size=1, max_size=4),
       unknown=st.lists(st.tuples(st.sampled_from(["", "data", "model", "trainer", "optimizer"]),
                                  st.text(min_size=1, max_size=10)), max_size=2))
def _fuzz_sections(tmpdir_module, edits, unknown):
    raw = copy.deepcopy(DEFAULTS)
    for path, value in edits:
        node = raw
        for part in path[:-1]:
            node = node[part] if isinstance(node.get(part), dict) else node.setdefault(part, {})
            if not isinstance(node, dict):
                break
        else:
            if value == "<delete>":
                node.pop(path[-1], None)
            else:
                node[path[-1]] = value
    for section, key in unknown:
        node = raw.setdefault(section, {}) if section else raw
        if isinstance(node, dict):
            node[key] = 1
    text = yaml.safe_dump(raw, allow_unicode=True)
    _check(lambda: load_config(_write(tmpdir_module, text)), "wrong types / unknown keys / deleted fields")


@settings(max_examples=int(FULL or 150), **SETTINGS)
@given(args=st.lists(st.one_of(st.sampled_from(["--" + ".".join(p) for p in PATHS]), st.text(max_size=12),
                               st.sampled_from(["--", "--model", "--x.y.z", "--trainer=3", "--model.type=bert"])),
                     max_size=6))
def _fuzz_overrides(args):
    _check(lambda: load_config(None, args), "random command-line overrides")


@settings(max_examples=int(FULL or 60), **SETTINGS)
@given(n=st.integers(1, 5), back=st.integers(0, 4), missing=st.booleans(), section=st.sampled_from(["model", "data", "trainer"]))
def _fuzz_includes(tmpdir_module, n, back, missing, section):
    """A chain of n files where the last includes an earlier one (a cycle) or a missing file."""
    d = tmpdir_module / f"inc-{n}-{back}-{missing}-{section}"
    d.mkdir(exist_ok=True)
    names = [f"f{i}.yaml" for i in range(n)]
    for i, name in enumerate(names):
        target = names[i + 1] if i + 1 < n else ("nope/missing.yaml" if missing else names[min(back, n - 1)])
        (d / name).write_text(f"{section}: !include {target}\n" if i == 0 else f"x: !include {target}\n")
    try:
        load_config(d / names[0])
    except ConfigError as e:
        assert ("not found" in str(e) and "missing.yaml" in str(e)) if missing else "include cycle" in str(e), str(e)
        TALLY.setdefault("include cycles / missing includes", {"cases": 0, "loaded": 0, "config_error": 0})
        TALLY["include cycles / missing includes"]["cases"] += 1
        TALLY["include cycles / missing includes"]["config_error"] += 1
        return
    raise AssertionError("an include cycle or a missing include loaded")


@pytest.mark.reliability("config fuzz (hypothesis)")
@pytest.mark.parametrize("kind", ["random YAML text", "wrong types / unknown keys / deleted fields",
                                  "random command-line overrides", "include cycles / missing includes"])
def test_config_fuzz(tmpdir_module, note, kind):
    TALLY.pop(kind, None)
    fuzz = {"random YAML text": lambda: _fuzz_yaml_text(tmpdir_module),
            "wrong types / unknown keys / deleted fields": lambda: _fuzz_sections(tmpdir_module),
            "random command-line overrides": _fuzz_overrides,
            "include cycles / missing includes": lambda: _fuzz_includes(tmpdir_module)}[kind]
    fuzz()  # every hypothesis example
    t = TALLY[kind]
    assert t["cases"] == t["loaded"] + t["config_error"] >= 20
    note(f"{t['cases']} generated configs: {t['config_error']} ended in a ConfigError naming the field or "
         f"file, {t['loaded']} loaded, 0 other exceptions", cases=t["cases"])
