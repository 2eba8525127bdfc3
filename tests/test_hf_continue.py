"""Continuing Hugging Face models and exporting the runs: what the starting model had is kept, and
the guides' command forms work.

* A Llama with 128 positions trained at seq_len 64 is exported with its 128 positions, and the
  export gives ``transformers`` our logits.
* A model whose embedding has more rows than its tokenizer has tokens (a padded vocabulary)
  continues: step-0 loss equals ``transformers``' on the same tokens, it trains, and the export
  keeps the padded rows.
* Runs sharing ``hf_save_path`` export under their own run ids.
* ``eval`` of a Hugging Face directory uses the config's store for its XLA compilation cache.
* Levanter's ``export --config_path ... --output_dir ...`` (no checkpoint path), LLM-Trainer's
  ``--resume_from_checkpoint`` without a value, and its best model kept by default.

Every reference is computed by ``transformers`` (torch) on tiny models it writes here.
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

SEQ = 64  # the runs' sequence length
LLAMA_POSITIONS = 128  # the starting Llama's max_position_embeddings
PAD = 20  # extra embedding rows of the padded model


@pytest.fixture(autouse=True)
def exact_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def _perturb_and_save(model, path: str) -> None:
    with torch.no_grad():  # larger than init weights, so that a wrong mapping shows in the loss
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(path)


def make_llama_128(path: str) -> str:
    tiny_tokenizer(path, vocab_size=300)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=tokenizer_info(path).vocab_size, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=5e5,
                                   tie_word_embeddings=False, max_position_embeddings=LLAMA_POSITIONS)
    _perturb_and_save(transformers.LlamaForCausalLM(cfg), path)
    return path


def make_padded_gpt2(path: str) -> str:
    """A GPT-2 whose embedding (and tied head) has PAD rows beyond its tokenizer's ids."""
    tiny_tokenizer(path, vocab_size=300)
    torch.manual_seed(1)
    cfg = transformers.GPT2Config(vocab_size=tokenizer_info(path).vocab_size + PAD, n_embd=64, n_inner=96, n_layer=2,
                                  n_head=4, n_positions=SEQ)
    _perturb_and_save(transformers.GPT2LMHeadModel(cfg), path)
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


def write_config(path: str, *, hf_dir: str, family: str, data: tuple[str, str], store: str, hf_saves: str,
                 model: str = "", trainer: str) -> str:
    with open(path, "w") as f:
        f.write(f"""\
data:
  train_urls: [{data[0]}]
  validation_urls: [{data[1]}]
  on_invalid: skip
model:
  type: {family}
  gradient_checkpointing: false
{model}initialize_from_hf: {hf_dir}
use_hf_model_config: true
hf_save_steps: 2
hf_save_path: {hf_saves}
trainer:
  train_batch_size: 4
  max_eval_batches: 1
  mp: f32
  seed: 0
{trainer}optimizer:
  learning_rate: 1.0e-2
  warmup: 0.0
eval:
  batch_size: 4
  max_eval_batches: 1
store:
  root: {store}
""")
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Data, one store and one hf_save_path shared by the runs below."""
    root = tmp_path_factory.mktemp("hfcontinue")
    return {"root": root, "data": write_data(str(root / "data")), "store": str(root / "store"),
            "hf_saves": str(root / "hf-saves")}


def _train(config: str) -> dict:
    from lm_pipeline.steps import Pipeline

    pipe = Pipeline(load_config(config), progress=False)
    res = pipe.build("train_ckpt")
    return {"config": config, "pipe": pipe, "result": res, "run_id": pipe.run_id(),
            "final": res.manifest["final_checkpoint"], "hf_dir": pipe.cfg.initialize_from_hf}


@pytest.fixture(scope="module")
def llama_run(setup):
    """The 128-position Llama trained at seq_len 64 for 2 steps, its trainer written with
    LLM-Trainer's keys (checkpoints under a checkpoint_dir)."""
    root = setup["root"]
    common = {k: setup[k] for k in ("data", "store", "hf_saves")}
    return _train(write_config(
        str(root / "llama.yaml"), hf_dir=make_llama_128(str(root / "llama128")), family="llama",
        model=f"  seq_len: {SEQ}\n", **common,
        trainer=(f"  num_train_steps: 2\n  checkpoint_dir: {root / 'checkpoints'}\n  save_steps: 2\n"
                 "  eval_steps: 2\n  logging_steps: 1\n")))


@pytest.fixture(scope="module")
def padded_run(setup):
    """The padded-vocabulary GPT-2 trained for 3 steps (Levanter's keys)."""
    root = setup["root"]
    common = {k: setup[k] for k in ("data", "store", "hf_saves")}
    return _train(write_config(
        str(root / "padded.yaml"), hf_dir=make_padded_gpt2(str(root / "padded")), family="gpt2", **common,
        trainer="  num_train_steps: 3\n  steps_per_eval: 100\n"))


def _batch(pipe, rows: int = 4) -> np.ndarray:
    _, evals, _, _ = pipe.datasets(pipe.token_cache())
    return evals["validation"].get_many(range(rows)).tokens


# --- 10a: the starting model's positions ------------------------------------------------------


def test_llama_trained_shorter_exports_the_source_positions_and_same_logits(setup, llama_run, tmp_path, capsys):
    from lm_pipeline.eval import load_model_from_checkpoint

    run = llama_run
    out = str(tmp_path / "export")
    assert main(["export", "--config_path", run["config"], "--checkpoint_path", run["final"], "--output_dir", out]) == 0
    conf = json.loads(open(os.path.join(out, "config.json")).read())
    assert load_config(run["config"]).model.seq_len == SEQ
    assert conf["max_position_embeddings"] == LLAMA_POSITIONS  # not the run's 64
    during = os.path.join(setup["hf_saves"], run["run_id"], "step-2", "config.json")
    assert json.loads(open(during).read())["max_position_embeddings"] == LLAMA_POSITIONS  # hf_save_steps too
    batch = _batch(run["pipe"])
    _, ours = our_loss(load_model_from_checkpoint(run["final"]).model, batch)
    _, theirs = torch_loss_and_logits(out, batch)
    diff = np.abs(ours - theirs).max()
    with capsys.disabled():
        print(f"\nllama 128 positions trained at {SEQ}: export max_position_embeddings "
              f"{conf['max_position_embeddings']}, max |logit diff| vs transformers {diff:.2e}")
    assert diff <= 1e-4 * np.abs(theirs).max()


# --- 11: a padded vocabulary ------------------------------------------------------------------


def test_padded_vocabulary_continues_with_transformers_loss_at_step0(padded_run, tmp_path, capsys):
    from lm_pipeline.eval import load_model_from_checkpoint
    from lm_pipeline.train.run import _prepare, _restore_or_init

    run = padded_run
    pipe, hf_dir = run["pipe"], run["hf_dir"]
    train_ds, _, _, tok_vocab = pipe.datasets(pipe.token_cache())
    rows = json.loads(open(os.path.join(hf_dir, "config.json")).read())["vocab_size"]
    assert rows == tok_vocab + PAD
    batch = _batch(pipe)
    # step 0: the state the trainer starts from
    state, resumed = _restore_or_init(_prepare(pipe.cfg, train_ds, tok_vocab, None, "step0", str(tmp_path / "run0")))
    assert resumed is None and state.model.token_embeddings.shape[0] == rows  # the padded rows are kept
    ours, _ = our_loss(state.model, batch)
    ref, _ = torch_loss_and_logits(hf_dir, batch)
    # it trained (3 steps), keeping the padded rows
    trained = load_model_from_checkpoint(run["final"])
    after, logits = our_loss(trained.model, batch)
    with capsys.disabled():
        print(f"\npadded vocabulary ({tok_vocab} tokens, {rows} rows): step-0 loss ours {ours:.7f} transformers "
              f"{ref:.7f} rel {abs(ours - ref) / ref:.2e}; after 3 steps {after:.7f}")
    assert abs(ours - ref) <= 1e-4 * abs(ref)
    assert run["result"].summary["final_step"] == 3 and np.isfinite(after) and after != pytest.approx(ours, rel=1e-6)
    assert trained.vocab_size == rows
    # the export has the model's rows, as the starting model had, and the same logits in transformers
    out = str(tmp_path / "export")
    assert main(["export", "--config_path", run["config"], "--checkpoint_path", run["final"], "--output_dir", out]) == 0
    assert json.loads(open(os.path.join(out, "config.json")).read())["vocab_size"] == rows
    _, theirs = torch_loss_and_logits(out, batch)
    assert np.abs(logits - theirs).max() <= 1e-4 * np.abs(theirs).max()


def test_a_run_started_from_a_padded_runs_checkpoint_keeps_the_rows_and_the_record(padded_run, tmp_path):
    import dataclasses

    from lm_pipeline.hf.start import HF_SOURCE_FILE, hf_source_files, read_hf_source
    from lm_pipeline.train.run import _prepare, _restore_or_init

    run = padded_run
    pipe = run["pipe"]
    record = read_hf_source(run["final"])
    assert os.path.isfile(os.path.join(run["final"], HF_SOURCE_FILE)) and record["source"] == run["hf_dir"]
    cfg = dataclasses.replace(pipe.cfg, initialize_from_hf=None, use_hf_model_config=False,
                              trainer=dataclasses.replace(pipe.cfg.trainer, initialize_from=run["final"]))
    train_ds, _, _, tok_vocab = pipe.datasets(pipe.token_cache())
    state, _ = _restore_or_init(_prepare(cfg, train_ds, tok_vocab, None, "again", str(tmp_path / "run")))
    assert state.model.token_embeddings.shape[0] == record["config"]["vocab_size"] == tok_vocab + PAD
    assert json.loads(hf_source_files(cfg)[HF_SOURCE_FILE]) == record  # its checkpoints record the same start


def test_tokenizer_larger_than_the_model_is_refused_in_one_line(setup, tmp_path):
    from lm_pipeline.hf.start import model_vocab_size
    from lm_pipeline.schema import ConfigError

    hf_dir = make_padded_gpt2(str(tmp_path / "padded"))
    cfg = load_config(None, {"initialize_from_hf": hf_dir, "use_hf_model_config": True})
    rows = json.loads(open(os.path.join(hf_dir, "config.json")).read())["vocab_size"]
    assert model_vocab_size(cfg, rows - PAD) == rows
    with pytest.raises(ConfigError, match="embedding rows but the tokenizer has"):
        model_vocab_size(cfg, rows + 1)


# --- 10b: hf_save_path shared by runs ---------------------------------------------------------


def test_runs_sharing_hf_save_path_keep_both_exports(setup, llama_run, padded_run):
    from pathlib import Path

    saves = Path(setup["hf_saves"])
    llama, padded = llama_run["run_id"], padded_run["run_id"]
    assert llama != padded
    assert sorted(p.name for p in saves.iterdir()) == sorted([llama, padded])  # no step-N of either at the top
    assert sorted(p.name for p in (saves / llama).iterdir()) == ["step-2"]
    assert sorted(p.name for p in (saves / padded).iterdir()) == ["step-2", "step-3"]  # every 2 steps, and the end
    types = {json.loads((saves / rid / "step-2" / "config.json").read_text())["model_type"] for rid in (llama, padded)}
    assert types == {"llama", "gpt2"}


# --- 10c: eval of a Hugging Face directory and the XLA cache ---------------------------------


def test_eval_of_a_hf_directory_puts_the_xla_cache_in_the_configs_store(llama_run, tmp_path, monkeypatch):
    import lm_pipeline.eval.evaluate as evaluate

    used = []
    real = evaluate.enable_xla_cache
    monkeypatch.setattr(evaluate, "enable_xla_cache", lambda root, *a, **k: used.append(root) or real(root, *a, **k))
    run = llama_run
    store = load_config(run["config"]).store.root
    assert main(["eval", "--config_path", run["config"], "--checkpoint_path", run["hf_dir"],
                 "--output_dir", str(tmp_path / "eval")]) == 0
    assert used == [store], used  # not ./artifacts (the default of a config made up for the directory)
    from lm_pipeline.xla_cache import STORE_SUBDIR, cache_dir_for

    assert cache_dir_for(store, environ={}).startswith(os.path.join(store, STORE_SUBDIR))


# --- 12: the guides' forms ------------------------------------------------------------------


def test_export_with_only_config_and_output_dir_takes_the_runs_latest_checkpoint(llama_run, tmp_path, capsys):
    run = llama_run
    out = str(tmp_path / "export")
    assert main(["export", "--config_path", run["config"], "--output_dir", out]) == 0
    ref = str(tmp_path / "export-of-final")
    assert main(["export", "--config_path", run["config"], "--checkpoint_path", run["final"], "--output_dir", ref]) == 0
    for name in ("config.json", "model.safetensors"):
        assert open(os.path.join(out, name), "rb").read() == open(os.path.join(ref, name), "rb").read()
    capsys.readouterr()
    # a config whose run has no checkpoint: one line saying so
    assert main(["export", "--config_path", run["config"], "--trainer.seed", "7", "--output_dir", out]) == 2
    err = capsys.readouterr().err
    assert "no complete checkpoint" in err and "--checkpoint_path" in err


def test_resume_from_checkpoint_flag_without_a_value_resumes_from_the_checkpoint_dir(llama_run, capsys):
    run = llama_run
    capsys.readouterr()
    # another configuration (4 steps: another run id), resumed from the latest checkpoint in checkpoint_dir
    assert main(["train", "--config_path", run["config"], "--trainer.num_train_steps", "4",
                 "--resume_from_checkpoint"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[out.index("{"):])
    assert summary["resumed_from"] == run["final"] and summary["final_step"] == 4
    assert os.path.dirname(summary["final_checkpoint"]) != os.path.dirname(run["final"])  # its own run dir


def test_resume_from_checkpoint_forms_in_yaml_and_python():
    from lm_pipeline.compat.llm_trainer import DataConfig, ModelConfig, TrainingConfig, to_run_config

    t = load_config(None, {"trainer.checkpoint_dir": "ck", "trainer.resume_from_checkpoint": True}).trainer
    assert (t.load_checkpoint, t.load_checkpoint_path) == (True, "ck")  # the latest in the checkpoint dir
    t = load_config(None, {"trainer.resume_from_checkpoint": True}).trainer
    assert (t.load_checkpoint, t.load_checkpoint_path) == (True, None)  # no checkpoint_dir: the run's own
    t = load_config(None, {"trainer.resume_from_checkpoint": "old/run"}).trainer
    assert (t.load_checkpoint, t.load_checkpoint_path) == (None, "old/run")
    small = ModelConfig(d_model=32, n_heads=2, n_layers=1, d_ff=64, max_seq_len=32)
    data = DataConfig(dataset_name=None, builtin="python_stdlib", max_length=32)
    py = to_run_config(small, TrainingConfig(checkpoint_dir="ck", resume_from_checkpoint=True), data, devices=1).trainer
    assert (py.load_checkpoint, py.load_checkpoint_path) == (True, "ck")


def test_best_model_is_kept_by_default_with_llm_trainer_keys(llama_run):
    from lm_pipeline.compat.llm_trainer import DataConfig, ModelConfig, TrainingConfig, to_run_config
    from lm_pipeline.train.checkpoint.marker import BEST_DIR, read_marker

    assert load_config(None, {"trainer.eval_steps": 10}).trainer.checkpointer.keep_best is True
    assert load_config(None, {"trainer.save_steps": 10}).trainer.checkpointer.keep_best is True
    assert load_config(None, {"trainer.checkpointer.save_steps": 10}).trainer.checkpointer.keep_best is True
    assert load_config(None, {"trainer.eval_steps": 10, "trainer.checkpointer.keep_best": False}
                       ).trainer.checkpointer.keep_best is False  # an explicit setting stays
    assert load_config(None, {"trainer.steps_per_eval": 10}).trainer.checkpointer.keep_best is False  # Levanter's
    assert load_config(None).trainer.checkpointer.keep_best is False
    small = ModelConfig(d_model=32, n_heads=2, n_layers=1, d_ff=64, max_seq_len=32)
    data = DataConfig(dataset_name=None, builtin="python_stdlib", max_length=32)
    assert to_run_config(small, TrainingConfig(), data, devices=1).trainer.checkpointer.keep_best is True
    # the run written with LLM-Trainer's keys kept its best model (its only evaluation, at step 2)
    run = llama_run
    best = os.path.join(os.path.dirname(run["final"]), BEST_DIR)
    marker = read_marker(best)
    assert marker is not None and marker["step"] == 2 and np.isfinite(marker["eval_loss"])
