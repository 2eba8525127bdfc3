"""Config loading, command-line overrides and their error messages, checked against values the
tests write down themselves.

- A list given on the command line (``--data.train_urls [...]``) replaces the file's list.
- An override's value may itself hold ``=`` (``--store.root=/a/x=y``): only the first ``=``
  separates key and value, on the command line and in an override string.
- An invalid YAML file's error names the file and the line of the problem, counted from the
  top of the file as written.
- Two training sources in the data section: the error names the field to remove (the second
  source, ``data.hf_id``).
"""

from __future__ import annotations

import pytest
import yaml

from lm_pipeline.config import load_config, parse_override_text, parse_overrides
from lm_pipeline.schema import ConfigError, flat_problems


def test_a_list_override_replaces_the_files_list(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"data": {"train_urls": ["a.jsonl", "b.jsonl"]}}))
    cfg = load_config(path, ["--data.train_urls", "[c.jsonl]"])
    assert cfg.data.train_urls == ("c.jsonl",)
    cfg = load_config(path, ["--data.train_urls=[c.jsonl, d.jsonl]"])
    assert cfg.data.train_urls == ("c.jsonl", "d.jsonl")


def test_an_override_value_may_hold_an_equals_sign(tmp_path):
    root = f"{tmp_path}/store=1"
    assert parse_overrides([f"--store.root={root}"]) == [("store.root", root)]
    assert parse_override_text(f"store.root={root} model.num_layers=3") == [("store.root", root),
                                                                           ("model.num_layers", 3)]
    assert load_config(None, [f"--store.root={root}"]).store.root == root


def test_invalid_yaml_names_the_file_and_the_line(tmp_path):
    lines = ["model:", "  num_layers: 2", "trainer:", "  num_train_steps: [1, 2", "  seed: 3"]
    path = tmp_path / "bad.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert str(path) in text and "invalid YAML" in text
    opened = lines.index("  num_train_steps: [1, 2") + 1  # 1-based: the unclosed list
    broken = lines.index("  seed: 3") + 1  # where the parser finds ':' instead of ',' or ']'
    assert f"line {opened}, column" in text
    assert f"line {broken}, column" in text
    assert f"line {len(lines) + 1}," not in text


def test_two_training_sources_name_the_one_to_remove():
    with pytest.raises(ConfigError) as info:
        load_config(None, {"data.train_urls": ["a.jsonl"], "data.hf_id": "org/name"})
    problems = [p for p in flat_problems([info.value]) if "only one training source" in p.message]
    assert [p.path for p in problems] == ["data.hf_id"]

