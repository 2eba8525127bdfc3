"""Hugging Face export / import: transformers parity, padded vocabularies, sharding, byte-identical
round trips, atomic writes, refusing pickles and remote code."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import pathlib
import pickle
import re

import equinox as eqx
import jax
import numpy as np
import pytest
from helpers.data import tiny_tokenizer

from lm_pipeline.data.tokenizer import load_tokenizer, tokenizer_info
from lm_pipeline.hf import (
    ExportConfig,
    UnsafeCheckpointError,
    config_from_hf,
    export_hf,
    load_hf_checkpoint,
    parse_size,
    read_safetensors_dir,
)
from lm_pipeline.models import Gpt2Config, LlamaConfig, LmConfig
from lm_pipeline.models.layers import named_params, replace_params
from lm_pipeline.schema import ConfigError, from_dict


def hf_libs():
    """(torch, transformers), or skip: only the parity checks need them."""
    return pytest.importorskip("torch"), pytest.importorskip("transformers")

TOK_VOCAB = 300  # tiny_tokenizer's vocabulary
PADDED = 320  # the models' (padded) vocabulary
GPT2 = Gpt2Config(seq_len=64, hidden_dim=32, num_layers=2, num_heads=4)
LLAMA = LlamaConfig(seq_len=64, hidden_dim=32, intermediate_dim=48, num_layers=2, num_heads=4, num_kv_heads=2,
                    rope_theta=500.0)
CONFIGS = {"gpt2": GPT2, "llama": LLAMA}


@pytest.fixture(autouse=True)
def exact_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def make(cfg: LmConfig, vocab: int = PADDED, seed: int = 1, std: float = 0.1):
    """Random weights (norms around 1, nonzero biases) drawn by numpy."""
    skeleton = eqx.filter_eval_shape(cfg.build, vocab, key=jax.random.PRNGKey(0))
    rng = np.random.default_rng(seed)
    named = {
        name: (1.0 if name.endswith(".weight") else 0.0) + std * rng.standard_normal(leaf.shape, np.float32)
        for name, leaf in named_params(skeleton).items()
    }
    return replace_params(skeleton, named)


@eqx.filter_jit
def fwd(model, x):
    return model(x)


def ids(b: int, t: int, high: int = TOK_VOCAB, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(100 + seed).integers(0, high, (b, t), dtype=np.int64)


def hf_logits(path: str, x: np.ndarray) -> np.ndarray:
    torch, transformers = hf_libs()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(x)).logits.numpy()


def close_rel(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max(), np.abs(ours - ref).max()


def weight_bytes(path: str) -> dict[str, bytes]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")) + glob.glob(os.path.join(path, "*.index.json")))
    return {os.path.basename(f): pathlib.Path(f).read_bytes() for f in files}


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return tiny_tokenizer(str(tmp_path_factory.mktemp("tok")), vocab_size=TOK_VOCAB)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def exported(request, tokdir, tmp_path_factory):
    """(cfg, model with a padded vocabulary, export dir); Llama is exported sharded."""
    cfg = CONFIGS[request.param]
    model = make(cfg)
    out = str(tmp_path_factory.mktemp("export") / request.param)
    shard = "20KB" if request.param == "llama" else "5GB"
    export_hf(model, out, tokenizer_dir=tokdir, max_shard_size=shard)
    return cfg, model, out


def test_exported_model_matches_in_transformers(exported, tokdir):
    cfg, model, out = exported
    names = set(os.listdir(out))
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    if cfg.type == "llama":
        assert "model.safetensors.index.json" in names and "model.safetensors" not in names
        assert len([n for n in names if n.endswith(".safetensors")]) > 1
    else:
        assert "model.safetensors" in names and "model.safetensors.index.json" not in names
    hf_conf = json.loads(pathlib.Path(out, "config.json").read_text())
    info = tokenizer_info(tokdir)
    assert hf_conf["vocab_size"] == TOK_VOCAB and hf_conf["eos_token_id"] == info.eos_id
    # No padded vocabulary rows leak into the exported weights; a tied head is stored once.
    state = read_safetensors_dir(out)
    assert all(PADDED not in v.shape for v in state.values())
    assert ("lm_head.weight" in state) == (cfg.type == "llama" and not cfg.tie_word_embeddings)

    x = ids(2, 12)
    ref = hf_logits(out, x)
    ours = np.asarray(fwd(model, x.astype(np.int32)))[..., :TOK_VOCAB]
    close_rel(ours, ref)

    tok = hf_libs()[1].AutoTokenizer.from_pretrained(out)
    text = "naïve café 日本語 x 42"
    assert tok(text)["input_ids"] == load_tokenizer(tokdir).encode(text).ids
    assert tok.eos_token_id == info.eos_id


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_transformers_model_imports_with_same_logits(family, tmp_path):
    torch, transformers = hf_libs()
    cfg = dataclasses.replace(CONFIGS[family], tie_word_embeddings=True, use_bias=True) if family == "llama" else CONFIGS[family]
    from lm_pipeline.models.hf_mapping import hf_config

    kwargs = hf_config(cfg, 97)
    torch.manual_seed(0)
    hf_cfg = transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    with torch.no_grad():  # HF initialises norms to exactly 1 and biases to 0: perturb them
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)  # safetensors
    assert (tmp_path / "model.safetensors").exists()

    got_cfg, model = load_hf_checkpoint(str(tmp_path))
    assert got_cfg == cfg
    x = ids(2, 10, high=97, seed=3)
    with torch.no_grad():
        ref = hf(torch.tensor(x)).logits.numpy()
    close_rel(np.asarray(fwd(model, x.astype(np.int32))), ref)

    # use_hf_model_config=False keeps our config (here a longer seq_len); the weights must fit it.
    longer = dataclasses.replace(cfg, seq_len=128) if family == "llama" else cfg
    kept, _ = load_hf_checkpoint(str(tmp_path), config=longer, use_hf_model_config=False)
    assert kept == longer
    with pytest.raises(ValueError, match="shape"):
        load_hf_checkpoint(str(tmp_path), config=dataclasses.replace(cfg, num_layers=1, hidden_dim=16),
                           use_hf_model_config=False)


@pytest.mark.parametrize("dtype,shard", [(None, "5GB"), ("bfloat16", "8KB")], ids=["f32-single", "bf16-sharded"])
def test_export_import_export_is_byte_identical(dtype, shard, tmp_path, tokdir):
    model = make(LLAMA)
    a = export_hf(model, tmp_path / "a", tokenizer_dir=tokdir, dtype=dtype, max_shard_size=shard)
    cfg, back = load_hf_checkpoint(a)
    assert cfg == LLAMA
    b = export_hf(back, tmp_path / "b", tokenizer_dir=tokdir, dtype=dtype, max_shard_size=shard)
    wa, wb = weight_bytes(a), weight_bytes(b)
    assert wa and wa == wb
    assert (len(wa) > 1) == (shard == "8KB")
    conf = json.loads(pathlib.Path(a, "config.json").read_text())
    assert conf["dtype"] == (dtype or "float32")
    assert pathlib.Path(a, "config.json").read_bytes() == pathlib.Path(b, "config.json").read_bytes()


def test_transformers_pipeline_generates_text(tmp_path, tokdir):
    out = export_hf(make(GPT2), tmp_path / "gpt2", tokenizer_dir=tokdir)
    generator = hf_libs()[1].pipeline("text-generation", model=out, device="cpu")
    res = generator("alpha beta", max_new_tokens=6, do_sample=False)
    assert isinstance(res[0]["generated_text"], str) and res[0]["generated_text"].startswith("alpha beta")


def test_export_is_atomic_and_replaces(tmp_path, tokdir):
    model = make(GPT2)
    out = tmp_path / "export"
    export_hf(model, out, tokenizer_dir=tokdir)
    first = weight_bytes(str(out))
    with pytest.raises(FileExistsError):
        export_hf(model, out, tokenizer_dir=tokdir, overwrite=False)
    broken = tmp_path / "broken_tok"
    broken.mkdir()
    (broken / "tokenizer_config.json").write_text("{}")
    with pytest.raises(Exception):  # noqa: B017 (no tokenizer.json): fails mid-export
        export_hf(make(GPT2, seed=2), out, tokenizer_dir=broken, vocab_size=TOK_VOCAB)
    assert weight_bytes(str(out)) == first  # the previous export is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken_tok", "export"]  # no temp dirs left
    export_hf(make(GPT2, seed=2), out, tokenizer_dir=tokdir)
    assert weight_bytes(str(out)) != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken_tok", "export"]


class _Payload:
    """Unpickling this creates a file: proof that a pickle was (not) loaded."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_refuses_pickle_weights_and_remote_code(tmp_path):
    sentinel = tmp_path / "unpickled"
    d = tmp_path / "pickled"
    d.mkdir()
    from lm_pipeline.models.hf_mapping import hf_config

    (d / "config.json").write_text(json.dumps(hf_config(GPT2, 50)))
    for name in ("pytorch_model.bin", "model.pt"):
        (d / name).write_bytes(pickle.dumps(_Payload(str(sentinel))))
    with pytest.raises(UnsafeCheckpointError, match="pickle"):
        load_hf_checkpoint(str(d))
    assert not sentinel.exists()

    custom = tmp_path / "custom"
    custom.mkdir()
    (custom / "config.json").write_text(json.dumps({**hf_config(GPT2, 50), "auto_map": {"AutoModel": "x.Y"}}))
    with pytest.raises(UnsafeCheckpointError, match="trust_remote_code"):
        load_hf_checkpoint(str(custom))
    with pytest.raises(FileNotFoundError):
        load_hf_checkpoint(str(tmp_path / "nowhere/also-not-a-repo-id!"))


def test_config_from_hf_rejects_unsupported():
    from lm_pipeline.models.hf_mapping import hf_config

    for cfg in (GPT2, LLAMA, dataclasses.replace(LLAMA, head_dim=16, num_kv_heads=1, tie_word_embeddings=True)):
        assert config_from_hf(hf_config(cfg, 50)) == cfg
    base = hf_config(LLAMA, 50)
    with pytest.raises(ConfigError, match="rope"):
        config_from_hf({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
    with pytest.raises(ConfigError, match="mlp_bias"):
        config_from_hf({**base, "attention_bias": True, "mlp_bias": False})
    with pytest.raises(ConfigError, match="model_type"):
        config_from_hf({**base, "model_type": "mistral"})
    # transformers >= 5 writes rope_parameters instead of rope_theta
    v5 = {k: v for k, v in base.items() if k != "rope_theta"} | {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}
    assert config_from_hf(v5).rope_theta == 500.0
    # both forms, disagreeing: refused (transformers would use rope_parameters', silently)
    both = {**base, "rope_theta": 10000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    with pytest.raises(ConfigError, match=r"rope_theta 10000.0 and rope_parameters.rope_theta 500000.0"):
        config_from_hf(both)
    agree = {**base, "rope_theta": 500000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 500000}}
    assert config_from_hf(agree).rope_theta == 500000.0
    # any n_inner: a width that is no multiple of n_embd is a fractional mlp_scale
    odd = config_from_hf({**hf_config(GPT2, 50), "n_inner": 50})
    assert odd.mlp_dim == 50 and odd.mlp_scale == 50 / GPT2.hidden_dim


def test_export_config_and_sizes():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(1234) == 1234
    assert parse_size("500 MB") == 500 * 10**6 and parse_size("10kb") == 10_000
    for bad in ("lots", "-1GB", 0):
        with pytest.raises(ValueError):
            parse_size(bad)
    cfg = from_dict(ExportConfig, {"hf_save_steps": 100, "hf_upload": "org/name", "dtype": "bfloat16"})
    assert cfg.max_shard_size == "5GB" and cfg.hf_save_path is None
    for data, path in (({"max_shard_size": "huge"}, "max_shard_size"), ({"hf_upload": "not a repo"}, "hf_upload"),
                       ({"hf_save_steps": 0}, "hf_save_steps"), ({"dtype": "int8"}, "dtype")):
        with pytest.raises(ConfigError) as e:
            from_dict(ExportConfig, data)
        assert e.value.path == path


def test_export_hook_writes_every_n_steps(tmp_path, tokdir):
    from types import SimpleNamespace

    from lm_pipeline.hf import export_hook

    assert export_hook(ExportConfig(), run_dir=str(tmp_path)) is None
    hook = export_hook(ExportConfig(hf_save_steps=5, dtype="bfloat16"), run_dir=str(tmp_path), tokenizer_dir=tokdir)
    assert hook.every == 5
    hook.fn(SimpleNamespace(step=10, state=SimpleNamespace(model=make(GPT2)), metrics={}))
    out = tmp_path / "hf" / "step-10"
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()


def test_export_shows_progress_and_passes_its_faultpoint(tmp_path, tokdir, capsys, monkeypatch):
    trace = tmp_path / "trace"
    monkeypatch.setenv("LM_PIPELINE_FAULTPOINT_TRACE", str(trace))
    out = export_hf(make(LLAMA), tmp_path / "shown", tokenizer_dir=tokdir, progress=True)
    err = capsys.readouterr().err
    assert "export" in err and "100%" in err  # the bar's final state: bytes written, rate
    assert "export.after_weights" in trace.read_text().split()
    export_hf(make(LLAMA), tmp_path / "quiet", tokenizer_dir=tokdir)  # not a terminal: no bar
    assert "export" not in capsys.readouterr().err
    assert pathlib.Path(out, "model.safetensors").is_file()


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_weights_that_do_not_fit_the_config_name_the_tensor(family, tmp_path):
    from safetensors.numpy import load_file, save_file

    from lm_pipeline.hf.load import HfWeightsError

    cfg = CONFIGS[family]
    out = str(tmp_path / "hf")
    export_hf(make(cfg), out)
    # the config of another shape: the first tensor that does not fit is named, with its shape
    small = dataclasses.replace(cfg, num_layers=1, hidden_dim=16)
    with pytest.raises(HfWeightsError, match=r"tensor '[a-z_.0-9]+' of shape \(32, 32\) does not fit"):
        load_hf_checkpoint(out, config=small, use_hf_model_config=False)
    # a tensor missing from the weights: named
    weights = load_file(f"{out}/model.safetensors")
    gone = next(k for k in sorted(weights) if ".1." in k)  # one of the second layer's tensors
    del weights[gone]
    save_file(weights, f"{out}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HfWeightsError, match=rf"no tensor '{re.escape(gone)}'"):
        load_hf_checkpoint(out)
