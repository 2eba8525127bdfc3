"""A Hugging Face model directory on this machine is one however its location is spelled (a path,
a ``file://`` URL, ``~``): recognised, read and named by content alike; hub ids and object-store
URLs are not taken for local directories."""

from __future__ import annotations

import hashlib
import json

import numpy as np
from safetensors.numpy import save_file

from lm_pipeline.hf.start import hf_weights_identity, is_hf_model_dir, read_hf_config_json


def test_a_local_hf_directory_is_one_however_it_is_spelled(tmp_path, monkeypatch):
    d = tmp_path / "m"
    d.mkdir()
    conf = {"model_type": "gpt2", "n_embd": 8, "n_layer": 1}
    (d / "config.json").write_text(json.dumps(conf))
    save_file({"wte.weight": np.arange(8, dtype=np.float32).reshape(4, 2)}, str(d / "model.safetensors"))
    monkeypatch.setenv("HOME", str(tmp_path))
    spellings = [str(d), f"file://{d}", "~/m"]

    assert [is_hf_model_dir(s) for s in spellings] == [True] * 3
    assert [read_hf_config_json(s) for s in spellings] == [conf] * 3
    weights = hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()
    expected = "sha256:" + hashlib.sha256(f"model.safetensors\0{weights}\n".encode()).hexdigest()
    assert [hf_weights_identity(s) for s in spellings] == [expected] * 3

    assert not is_hf_model_dir("org/name") and not is_hf_model_dir(f"memory://{d}")
    (d / "checkpoint.json").write_text("{}")  # a checkpoint of ours, not a Hugging Face directory
    assert not is_hf_model_dir(str(d))
