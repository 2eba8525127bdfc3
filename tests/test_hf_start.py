"""Continued pretraining from Hugging Face models (``initialize_from_hf`` + ``use_hf_model_config``)
and Hugging Face directories wherever a checkpoint is accepted (``eval``, ``export``, ``generate``).

Every reference is computed by ``transformers`` (torch) on a tiny model directory that
``transformers`` writes here: a GPT-2 whose ``n_inner`` is no multiple of ``n_embd`` and a Llama
with grouped-query attention, untied head, head_dim != hidden / heads and rope_theta 5e5.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from helpers.data import sample_texts, tiny_tokenizer
from helpers.hf_reference import our_loss, torch_loss_and_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lm_pipeline.cli import main  # noqa: E402
from lm_pipeline.config import load_config  # noqa: E402
from lm_pipeline.data.tokenizer import tokenizer_info  # noqa: E402
from lm_pipeline.schema import ConfigError  # noqa: E402

SEQ = 32


@pytest.fixture(autouse=True)
def exact_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def make_hf_dir(path: str, family: str) -> str:
    """A tiny random transformers model + tokenizer saved at ``path``."""
    tiny_tokenizer(path, vocab_size=300)
    vocab = tokenizer_info(path).vocab_size
    torch.manual_seed(0)
    if family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=192, intermediate_size=160, num_hidden_layers=2,
                                       num_attention_heads=6, num_key_value_heads=3, head_dim=24, rope_theta=5e5,
                                       tie_word_embeddings=False, max_position_embeddings=SEQ)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=64, n_inner=96, n_layer=2, n_head=4, n_positions=SEQ)
        model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # larger than init weights, so that a wrong mapping shows in the loss
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def write_data(root: str) -> tuple[str, str]:
    os.makedirs(root, exist_ok=True)
    out = []
    for name, n, seed in (("train", 200, 0), ("val", 40, 1)):
        path = os.path.join(root, f"{name}.jsonl")
        with open(path, "w") as f:
            for t in sample_texts(n, seed=seed):
                f.write(json.dumps({"text": t}) + "\n")
        out.append(path)
    return out[0], out[1]


def write_config(path: str, hf_dir: str, train: str, val: str, store: str, family: str) -> str:
    with open(path, "w") as f:
        f.write(f"""\
data:
  train_urls: [{train}]
  validation_urls: [{val}]
  on_invalid: skip
model:
  type: {family}
  seq_len: {SEQ}
  gradient_checkpointing: false
initialize_from_hf: {hf_dir}
use_hf_model_config: true
trainer:
  num_train_steps: 3
  train_batch_size: 4
  steps_per_eval: 100
  max_eval_batches: 1
  mp: f32
  seed: 0
optimizer:
  learning_rate: 1.0e-2
  warmup: 0.0
eval:
  batch_size: 4
  max_eval_batches: 1
store:
  root: {store}
""")
    return path


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def setup(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(f"hfstart-{family}")
    hf_dir = make_hf_dir(str(root / "hf"), family)
    train, val = write_data(str(root / "data"))
    cfg_path = write_config(str(root / "run.yaml"), hf_dir, train, val, str(root / "store"), family)
    return family, root, hf_dir, cfg_path


def test_config_takes_shape_and_tokenizer_from_the_directory(setup):
    family, _, hf_dir, cfg_path = setup
    cfg = load_config(cfg_path)
    assert cfg.data.tokenizer.kind == "hf" and cfg.data.tokenizer.name_or_path == hf_dir
    if family == "llama":
        m = cfg.model
        assert (m.hidden_dim, m.num_heads, m.num_kv_heads, m.head_dim, m.rope_theta, m.tie_word_embeddings,
                m.intermediate_dim) == (192, 6, 3, 24, 5e5, False, 160)
    else:
        assert cfg.model.mlp_dim == 96 and cfg.model.hidden_dim == 64  # n_inner no multiple of n_embd
    assert cfg.model.seq_len == SEQ  # a key written under model: overrides the directory's


def test_step0_loss_matches_transformers_then_train_export_load_back(setup, tmp_path):
    from lm_pipeline.eval import load_model_from_checkpoint
    from lm_pipeline.hf import export_hf
    from lm_pipeline.steps import Pipeline
    from lm_pipeline.train.run import _prepare, _restore_or_init

    family, root, hf_dir, cfg_path = setup
    cfg = load_config(cfg_path)
    pipe = Pipeline(cfg)
    train_ds, evals, _, vocab = pipe.datasets(pipe.token_cache())
    batch = evals["validation"].get_many(range(4)).tokens
    # step 0: the state the trainer starts from (fresh init, then the HF weights)
    run = _prepare(cfg, train_ds, vocab, None, "step0", str(tmp_path / "run0"))
    state, resumed = _restore_or_init(run)
    assert resumed is None
    ours, _ = our_loss(state.model, batch)
    ref, _ = torch_loss_and_logits(hf_dir, batch)
    print(f"{family} step-0 loss ours {ours:.7f} transformers {ref:.7f} rel {abs(ours - ref) / ref:.2e}")
    assert abs(ours - ref) <= 1e-4 * abs(ref)
    # train 3 steps through the pipeline, export, load the export with transformers
    res = pipe.build("train_ckpt")
    final = res.manifest["final_checkpoint"]
    trained = load_model_from_checkpoint(final)
    after, logits = our_loss(trained.model, batch)
    assert after != pytest.approx(ours, rel=1e-6)  # it trained
    out = export_hf(final, str(tmp_path / "export"))
    ref_after, ref_logits = torch_loss_and_logits(out, batch)
    diff = np.abs(logits - ref_logits).max()
    print(f"{family} after 3 steps: loss ours {after:.7f} transformers(export) {ref_after:.7f}; "
          f"max |logit diff| {diff:.2e} of max |logit| {np.abs(ref_logits).max():.2f}")
    assert diff <= 1e-4 * np.abs(ref_logits).max()


def test_fingerprint_names_the_weights_by_content(setup, tmp_path):
    import shutil

    from lm_pipeline.steps import Pipeline

    family, root, hf_dir, cfg_path = setup
    fp = Pipeline(load_config(cfg_path)).run_id()
    copy = str(tmp_path / "copy")
    shutil.copytree(hf_dir, copy)
    assert Pipeline(load_config(cfg_path, {"initialize_from_hf": copy})).run_id() == fp  # a path is no identity
    other = make_hf_dir(str(tmp_path / "other"), family)
    with open(os.path.join(other, "model.safetensors"), "r+b") as f:  # same config, other weights
        f.seek(-4, 2)
        f.write(b"\x00\x00\x80\x3f")
    assert Pipeline(load_config(cfg_path, {"initialize_from_hf": other})).run_id() != fp


def test_cli_eval_export_generate_accept_a_hf_directory(setup, tmp_path, capsys):
    from lm_pipeline.steps import Pipeline

    family, root, hf_dir, cfg_path = setup
    assert main(["eval", "--config_path", cfg_path, "--checkpoint_path", hf_dir,
                 "--output_dir", str(tmp_path / "eval")]) == 0
    report = json.loads((tmp_path / "eval" / "eval_report.json").read_text())
    rows = report if isinstance(report, list) else report.get("rows", report)
    row = next(r for r in rows if r["dataset"] == "validation")
    pipe = Pipeline(load_config(cfg_path))
    _, evals, _, _ = pipe.datasets(pipe.token_cache())
    ref, _ = torch_loss_and_logits(hf_dir, evals["validation"].get_many(range(4)).tokens)
    with capsys.disabled():
        print(f"{family} eval of the HF dir: loss {row['loss']:.7f} transformers {ref:.7f}")
    assert abs(row["loss"] - ref) <= 1e-4 * ref
    capsys.readouterr()
    assert main(["export", "--config_path", cfg_path, "--checkpoint_path", hf_dir,
                 "--output_dir", str(tmp_path / "exp")]) == 0
    x = evals["validation"].get_many(range(2)).tokens
    np.testing.assert_allclose(torch_loss_and_logits(str(tmp_path / "exp"), x)[1], torch_loss_and_logits(hf_dir, x)[1],
                               rtol=0, atol=1e-5)
    capsys.readouterr()
    assert main(["generate", "--config_path", cfg_path, "--checkpoint_path", hf_dir, "--prompt", "alpha beta",
                 "--max_new_tokens", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("alpha beta")


def test_use_hf_model_config_needs_a_source_and_family_must_agree(setup, tmp_path):
    family, _, hf_dir, _ = setup
    with pytest.raises(ConfigError, match="use_hf_model_config.*initialize_from_hf"):
        load_config(None, {"use_hf_model_config": True})
    other = "llama" if family == "gpt2" else "gpt2"
    with pytest.raises(ConfigError, match="model.type"):
        load_config(None, {"initialize_from_hf": hf_dir, "use_hf_model_config": True, "model.type": other})


def test_trainer_initialize_from_accepts_a_hf_directory(setup, tmp_path):
    import dataclasses

    from lm_pipeline.steps import Pipeline
    from lm_pipeline.train.run import _prepare, _restore_or_init

    family, _, hf_dir, cfg_path = setup
    hf_cfg = load_config(cfg_path)
    cfg = dataclasses.replace(hf_cfg, initialize_from_hf=None, use_hf_model_config=False,
                              trainer=dataclasses.replace(hf_cfg.trainer, initialize_from=hf_dir))
    pipe = Pipeline(hf_cfg)
    train_ds, evals, _, vocab = pipe.datasets(pipe.token_cache())
    batch = evals["validation"].get_many(range(2)).tokens
    state, _ = _restore_or_init(_prepare(cfg, train_ds, vocab, None, "from-dir", str(tmp_path / "run")))
    ours, _ = our_loss(state.model, batch)
    ref, _ = torch_loss_and_logits(hf_dir, batch)
    assert abs(ours - ref) <= 1e-4 * abs(ref)
