"""Generation: greedy parity with transformers, the unrolled decoder vs model.decode, sampling
controls, EOS handling, generate_text from a checkpoint."""

from __future__ import annotations

import dataclasses
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.data import tiny_tokenizer

from lm_pipeline.config import RunConfig, dump_config
from lm_pipeline.data.tokenizer import load_tokenizer, tokenizer_info
from lm_pipeline.generate import generate, generate_text, select_tokens
from lm_pipeline.models import Gpt2Config, LlamaConfig, LmConfig
from lm_pipeline.models.layers import named_params, replace_params
from lm_pipeline.train.checkpoint import Checkpointer, CheckpointerConfig
from lm_pipeline.train.trainer import TrainState

TOK_VOCAB = 300
PADDED = 320
GPT2 = Gpt2Config(seq_len=64, hidden_dim=32, num_layers=2, num_heads=4)
LLAMA = LlamaConfig(seq_len=64, hidden_dim=32, intermediate_dim=48, num_layers=2, num_heads=4, num_kv_heads=2)
CONFIGS = {"gpt2": GPT2, "llama": LLAMA}
N = 12  # new tokens in most tests (same shapes reuse compiled programs)
VARIANTS = {
    "gpt2-layer-scaled": dataclasses.replace(GPT2, num_layers=3, scale_attn_by_inverse_layer_idx=True, activation_function="gelu"),
    "llama-tied-bias-mqa": dataclasses.replace(LLAMA, tie_word_embeddings=True, use_bias=True, head_dim=16, num_kv_heads=1),
}


@pytest.fixture(autouse=True)
def exact_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def make(cfg: LmConfig, vocab: int = PADDED, seed: int = 1, std: float = 0.3):
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


def prompt(b: int, t: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(10 + seed).integers(0, TOK_VOCAB, (b, t)).astype(np.int32)


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return tiny_tokenizer(str(tmp_path_factory.mktemp("tok")), vocab_size=TOK_VOCAB)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_greedy_matches_transformers(family, tmp_path, tokdir):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from lm_pipeline.hf import export_hf

    cfg = CONFIGS[family]
    model = make(cfg, std=0.1)
    out = export_hf(model, tmp_path / family, tokenizer_dir=tokdir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    p, n = prompt(1, 5, seed=1), 32
    hf.generation_config.eos_token_id = None  # 32 tokens on both sides
    with torch.no_grad():
        ref = hf.generate(torch.tensor(p, dtype=torch.long), attention_mask=torch.ones(p.shape, dtype=torch.long),
                          max_new_tokens=n, do_sample=False, pad_token_id=0)[0].numpy()
    ours = generate(model, p[0], n, vocab_size=TOK_VOCAB)
    assert ours.shape == ref.shape == (5 + n,)
    diff = np.flatnonzero(ours != ref)
    if len(diff):  # allowed only where the two best logits are within 1e-4 (a numerical tie)
        i = int(diff[0])
        logits = np.asarray(fwd(model, ours[None, :i]))[0, -1, :TOK_VOCAB]
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] < 1e-4, (i, ours, ref)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_unrolled_decoder_matches_model_decode_and_full_forward(name):
    # (the plain GPT-2 / Llama configs are checked against transformers above)
    model = make(VARIANTS[name])
    p = prompt(2, 4)
    greedy = generate(model, p, N, vocab_size=TOK_VOCAB)
    np.testing.assert_array_equal(greedy, generate(model, p, N, vocab_size=TOK_VOCAB, unroll_layers=False))
    # ... and the greedy choice of a plain full forward pass at every step
    logits = np.asarray(fwd(model, greedy[:, :-1]))[:, 3:, :TOK_VOCAB]
    np.testing.assert_array_equal(logits.argmax(-1), greedy[:, 4:])


@jax.jit
def _draws(logits, keys):
    top_k = jax.vmap(lambda k: select_tokens(logits, k, temperature=1.0, top_k=3))(keys)
    top_p = jax.vmap(lambda k: select_tokens(logits[:1], k, temperature=1.0, top_p=0.75))(keys)
    return top_k, top_p


def test_sampling_controls():
    model = make(GPT2)
    p = prompt(2, 4)
    kw = dict(vocab_size=TOK_VOCAB)  # (the same programs as the next test)
    greedy = generate(model, p, N, **kw)
    np.testing.assert_array_equal(generate(model, p, N, temperature=1.5, top_k=1, seed=4, **kw), greedy)
    a = generate(model, p, N, temperature=2.0, seed=7, **kw)
    assert not np.array_equal(a, greedy)
    np.testing.assert_array_equal(a, generate(model, p, N, temperature=2.0, seed=7, **kw))
    assert not np.array_equal(a, generate(model, p, N, temperature=2.0, seed=8, **kw))
    np.testing.assert_array_equal(generate(model, p, N, temperature=1e-4, seed=9, **kw), greedy)

    logits = np.log(np.random.default_rng(0).dirichlet(np.ones(50), size=4)).astype(np.float32)
    logits[0, :4] = np.log([0.5, 0.3, 0.1, 0.1])
    logits[0, 4:] = -30.0
    k3, p75 = (np.asarray(a) for a in _draws(jnp.asarray(logits), jax.random.split(jax.random.PRNGKey(0), 200)))
    top3 = np.argsort(-logits, axis=-1)[:, :3]
    assert all(set(k3[:, r]) == set(top3[r]) for r in range(1, 4))  # only (and all of) the top 3
    assert set(k3[:, 0]) == {0, 1, 2, 3}  # ties at the k-th logit are kept, as in transformers
    assert set(p75[:, 0]) == {0, 1}  # the smallest set reaching p = 0.75: the two most likely


def test_padded_vocabulary_never_chosen_and_eos_stops():
    model = make(GPT2)
    # Make padded ids the most likely ones: without vocab_size they would be generated.
    emb = model.token_embeddings.at[TOK_VOCAB:].multiply(100.0)
    boosted = eqx.tree_at(lambda m: m.token_embeddings, model, emb)
    p = prompt(2, 4)
    assert (generate(boosted, p, N)[:, 4:] >= TOK_VOCAB).any()
    assert (generate(boosted, p, N, vocab_size=TOK_VOCAB)[:, 4:] < TOK_VOCAB).all()
    assert (generate(boosted, p, N, vocab_size=TOK_VOCAB, temperature=2.0, seed=1)[:, 4:] < TOK_VOCAB).all()

    free = generate(model, p, N, vocab_size=TOK_VOCAB)
    eos = int(free[0, 4 + 3])  # row 0's 4th new token
    out = generate(model, p, N, eos_id=eos, pad_id=299, vocab_size=TOK_VOCAB)
    for r in range(2):  # each row is the free run up to its first EOS, then padding
        new = free[r, 4:].tolist()
        stop = new.index(eos) + 1 if eos in new else len(new)
        np.testing.assert_array_equal(out[r, : 4 + stop], free[r, : 4 + stop])
        assert (out[r, 4 + stop :] == 299).all()
    assert eos in out[0, 4:].tolist() and out[0, -1] == 299  # row 0 stopped early


def test_argument_checks():
    model = make(GPT2)
    with pytest.raises(ValueError, match="seq_len"):
        generate(model, prompt(1, 40), 30)
    with pytest.raises(ValueError, match="prompt_ids"):
        generate(model, np.zeros((1, 0), np.int32), 3)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, prompt(1, 3), 3, temperature=1.0, top_p=0.0)


def test_llama_generation_past_its_trained_context_warns(caplog):
    """Rotary positions run past seq_len, untrained: a warning says so; within it, none."""
    import logging

    model = make(LLAMA)
    with caplog.at_level(logging.WARNING, logger="lm_pipeline.generate"):
        generate(model, prompt(1, 4), N)
    assert not [r for r in caplog.records if "past the" in r.getMessage()]
    with caplog.at_level(logging.WARNING, logger="lm_pipeline.generate"):
        out = generate(model, prompt(1, 60), 8)
    assert out.shape == (1, 68)
    warned = [r.getMessage() for r in caplog.records if "past the" in r.getMessage()]
    assert len(warned) == 1 and "position 68, past the 64 positions" in warned[0]


def write_checkpoint(base: pathlib.Path, cfg: LmConfig, model, tokdir: str, step: int = 7) -> str:
    """A checkpoint as the trainer writes it: TrainState (with optimizer state), config, tokenizer."""
    params = eqx.filter(model, eqx.is_array)
    state = TrainState(jnp.asarray(step, jnp.int32), params, optax.adamw(1e-3).init(params),
                       jax.random.key_data(jax.random.key(0)))
    with Checkpointer(CheckpointerConfig(base_path=str(base)), async_save=False) as ckpt:
        return ckpt.save(step, state, extra_files={"config.yaml": dump_config(RunConfig(model=cfg)),
                                                   "tokenizer": pathlib.Path(tokdir)})


def test_generate_text_from_checkpoint(tmp_path, tokdir):
    model = make(LLAMA)
    step_dir = write_checkpoint(tmp_path / "run", LLAMA, model, tokdir)
    text = generate_text(tmp_path / "run", "alpha beta", N)  # a run dir: its latest checkpoint
    assert isinstance(text, str)
    tok = load_tokenizer(tokdir)
    info = tokenizer_info(tokdir)
    ids = tok.encode("alpha beta", add_special_tokens=False).ids
    new = generate(model, np.asarray(ids, np.int32), N, eos_id=info.eos_id, vocab_size=TOK_VOCAB)[len(ids):].tolist()
    if info.eos_id in new:
        new = new[: new.index(info.eos_id)]
    assert text == tok.decode(new, skip_special_tokens=True)
    assert generate_text(step_dir, ["alpha beta", "alpha beta"], N) == [text, text]
    assert isinstance(generate_text(step_dir, "", N), str)  # starts from EOS


@pytest.mark.parametrize("flags,names", [
    (["--max_new_tokens", "0"], ["max_new_tokens"]),
    (["--max_new_tokens", "-5"], ["max_new_tokens"]),
    (["--temperature", "-1"], ["temperature"]),
    (["--top_p", "0"], ["top_p"]),
    (["--top_k", "0"], ["top_k"]),
    (["--top_k", "0", "--top_p", "1.5"], ["top_k", "top_p"]),
])
def test_generate_refuses_bad_sampling_arguments_in_one_line_before_reading_anything(flags, names):
    """``lm-pipeline generate`` with an argument out of range: exit 2, one line naming the
    argument and what is allowed, no traceback -- before the (here missing) checkpoint is read."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "lm_pipeline.cli", "generate", "--checkpoint_path", "/nonexistent/ckpt",
                          "--prompt", "x", *flags], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "LM_PIPELINE_NO_TCMALLOC": "1", "JAX_PLATFORMS": "cpu"})
    err = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and len(err) == 1, out.stderr[-2000:]
    assert err[0].startswith("error: ") and "/nonexistent" not in err[0]
    for name in names:
        assert f"{name} must be" in err[0]


def test_sampling_arguments_are_checked_by_the_library_too():
    from lm_pipeline.generate import SamplingError, check_sampling

    check_sampling(1, 0.0, None, None)
    check_sampling(8, 0.7, 40, 1.0)  # the edges that are allowed
    for args in ((0,), (4, -0.1), (4, float("nan")), (4, 1.0, 0), (4, 1.0, None, 0.0), (4, 1.0, None, 1.01)):
        with pytest.raises(SamplingError):
            check_sampling(*args)
