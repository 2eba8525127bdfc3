"""Model families: shapes, masking, GQA, remat, parameter accounting, HF parity, KV-cache decode.

Compilation dominates the cost of these tests, so random test models are filled by numpy
(no XLA init program), shapes are shared between tests, and every model call is jitted.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from lm_pipeline.models import Gpt2Config, LlamaConfig, LmConfig
from lm_pipeline.models.hf_mapping import from_hf_state_dict, hf_config, to_hf_state_dict
from lm_pipeline.models.layers import attention, named_params, replace_params, segment_mask, softmax_attention
from lm_pipeline.schema import ConfigError, field, from_dict, to_dict

V = 61
GPT2 = Gpt2Config(seq_len=16, hidden_dim=32, num_layers=2, num_heads=4)
LLAMA = LlamaConfig(seq_len=16, hidden_dim=32, intermediate_dim=48, num_layers=2, num_heads=4, num_kv_heads=2)
CONFIGS = {"gpt2": GPT2, "llama": LLAMA}
LOGICAL = {"vocab", "embed", "mlp", "heads", "kv_heads", "head_dim", "layers", None}


def skeleton(cfg: LmConfig):
    return eqx.filter_eval_shape(cfg.build, V, key=jax.random.PRNGKey(0))


def make(cfg: LmConfig, seed: int = 1, std: float = 0.1):
    """A model for ``cfg`` with random weights (norm weights around 1, biases nonzero too, so
    layout mistakes show up), drawn by numpy."""
    rng = np.random.default_rng(seed)
    named = {
        name: (1.0 if name.endswith(".weight") else 0.0) + std * rng.standard_normal(leaf.shape, np.float32)
        for name, leaf in named_params(skeleton(cfg)).items()
    }
    return replace_params(skeleton(cfg), named)


def with_config(model, cfg: LmConfig):
    """``model``'s weights in a model for ``cfg`` (e.g. another non-weight setting)."""
    return replace_params(skeleton(cfg), named_params(model))


@eqx.filter_jit
def fwd(model, x, segment_ids=None):
    return model(x, segment_ids)


def tokens(b: int, t: int, seed: int = 0):
    return jnp.asarray(np.random.default_rng(100 + seed).integers(0, V, (b, t), dtype=np.int32))


@pytest.fixture(autouse=True)
def exact_matmuls():
    """Full f32 matmuls also on accelerators (no TF32), so the tight tolerances hold there."""
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request):
    cfg = CONFIGS[request.param]
    return cfg, make(cfg)


def close(a, b, tol=1e-5):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, atol=tol * max(1.0, float(np.abs(b).max())), rtol=0)


# ----------------------------------------------------------------------------- init


@pytest.mark.parametrize("cfg", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_build_initialisation(cfg):
    model = eqx.filter_jit(cfg.build)(V, key=jax.random.key(0))  # typed keys, as the trainer uses
    named = {k: np.asarray(v) for k, v in named_params(model).items()}
    out_std = 0.02 / np.sqrt(2 * cfg.num_layers) if isinstance(cfg, Gpt2Config) else 0.02
    expected = {"token_embeddings": 0.02, "blocks.mlp.up_proj": 0.02, "blocks.mlp.down_proj": out_std}
    attn = "blocks.attn." if isinstance(cfg, Gpt2Config) else "blocks.self_attn."
    expected |= {attn + "q_proj": 0.02, attn + "o_proj": out_std}
    for name, std in expected.items():
        assert named[name].std() == pytest.approx(std, rel=0.15), name
        assert abs(named[name].mean()) < 0.2 * std, name
    for name, value in named.items():
        if name.endswith(".weight"):
            np.testing.assert_array_equal(value, 1.0, err_msg=name)
        if name.endswith("_bias") or name.endswith(".bias"):
            np.testing.assert_array_equal(value, 0.0, err_msg=name)
    assert all(v.dtype == np.float32 for v in named.values())


# ----------------------------------------------------------------------------- forward


def test_shapes_and_dtypes(family):
    _, model = family
    logits = fwd(model, tokens(2, 8))
    assert logits.shape == (2, 8, V) and logits.dtype == jnp.float32
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, model)
    logits16 = fwd(half, tokens(2, 8))
    assert logits16.dtype == jnp.bfloat16
    assert bool(jnp.isfinite(logits16).all())
    close(logits16, logits, tol=0.1)


def test_causal(family):
    _, model = family
    x = tokens(2, 8)
    y = x.at[:, 5].set((x[:, 5] + 1) % V)
    a, b = fwd(model, x), fwd(model, y)
    close(a[:, :5], b[:, :5], tol=1e-6)
    assert float(jnp.abs(a[:, 5:] - b[:, 5:]).max()) > 1e-4


def test_packed_segments_match_separate_documents(family):
    _, model = family
    x = tokens(2, 8, seed=1)  # row 0 = doc A (5 tokens) + doc B (3 tokens); row 1: doc B first
    alone = jnp.stack([x[0], jnp.concatenate([x[0, 5:], x[1, 3:]])])
    seg = jnp.array([[1] * 5 + [2] * 3, [7] * 8], jnp.int32)
    packed, ref = fwd(model, x, seg), fwd(model, alone)  # causal: a prefix only sees itself
    close(packed[0, :5], ref[0, :5])
    close(packed[0, 5:], ref[1, :3])
    close(packed[1], fwd(model, x)[1])  # one segment == plain causal


def test_padding_rows_finite(family):
    _, model = family
    x = tokens(2, 8, seed=1)
    seg = jnp.array([[1, 1, 1, 1, 1, 0, 0, 0], [0] * 8], jnp.int32)
    out = fwd(model, x, seg)
    assert bool(jnp.isfinite(out).all())
    close(out[0, :5], fwd(model, x)[0, :5])


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = make(LLAMA)  # 4 query heads, 2 kv heads
    named = named_params(gqa)
    for w in ("k_proj", "v_proj"):  # [L, D, K, H]: kv head k serves query heads 2k and 2k + 1
        named[f"blocks.self_attn.{w}"] = jnp.repeat(named[f"blocks.self_attn.{w}"], 2, axis=2)
    mha = replace_params(skeleton(dataclasses.replace(LLAMA, num_kv_heads=4)), named)
    x = tokens(2, 8)
    close(fwd(gqa, x), fwd(mha, x))


@jax.jit
def _both_attention_paths(q, k, v, seg):
    outs = []
    for mask in (None, segment_mask(seg)):
        outs.append((softmax_attention(q, k, v, mask, scale=0.3), attention(q, k, v, mask, scale=0.3)))
    return outs


def test_softmax_path_matches_dot_product_attention():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 6, 4, 8), np.float32)
    k, v = rng.standard_normal((2, 2, 6, 2, 8), np.float32)  # GQA: 2 kv heads for 4 query heads
    seg = jnp.array([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
    for explicit, fast in _both_attention_paths(q, k, v, seg):
        close(explicit, fast)


def test_dropout_only_in_training():
    plain = make(GPT2)
    model = with_config(plain, dataclasses.replace(GPT2, embed_pdrop=0.1, resid_pdrop=0.1, attn_pdrop=0.1))
    x = tokens(2, 8)

    @eqx.filter_jit
    def run(m, x):
        train = [m(x, key=jax.random.key(s), inference=False) for s in (1, 1, 2)]
        return m(x), train

    inference, (a, b, c) = run(model, x)
    close(inference, fwd(plain, x), tol=1e-6)
    assert bool(jnp.isfinite(a).all())
    close(a, b, tol=0)
    assert float(jnp.abs(a - c).max()) > 1e-3
    with pytest.raises(ValueError, match="key"):
        model(x, inference=False)


def test_gradient_checkpointing_gives_equal_finite_grads(family):
    cfg, model = family
    other = with_config(model, dataclasses.replace(cfg, gradient_checkpointing=not cfg.gradient_checkpointing))
    x = tokens(2, 8)
    seg = jnp.array([[1] * 4 + [2] * 2 + [0] * 2, [0] * 8])  # packed docs, padding, an all-padding row

    @eqx.filter_jit
    @eqx.filter_grad
    def grad(m):
        return jnp.sum(jnp.where(seg[..., None] > 0, jax.nn.log_softmax(m(x, seg)), 0.0))

    def primitives(m):
        return str(eqx.filter_make_jaxpr(lambda m: m(x, seg))(m)[0])

    assert ("remat" in primitives(model)) == cfg.gradient_checkpointing
    assert ("remat" in primitives(other)) != cfg.gradient_checkpointing
    g1, g2 = grad(model), grad(other)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        assert bool(jnp.isfinite(a).all())
        close(a, b)


# ----------------------------------------------------------------------------- accounting


@pytest.mark.parametrize(
    "cfg",
    [
        GPT2,
        dataclasses.replace(GPT2, use_bias=False, mlp_scale=3),
        LLAMA,
        dataclasses.replace(LLAMA, tie_word_embeddings=True, use_bias=True, head_dim=16, num_kv_heads=1),
    ],
    ids=["gpt2", "gpt2-nobias", "llama", "llama-tied-bias-mqa"],
)
def test_num_params_matches_leaves(cfg):
    leaves = named_params(skeleton(cfg)).values()
    assert sum(int(np.prod(x.shape)) for x in leaves) == cfg.num_params(V)


def test_reference_sizes():
    # GPT-2 small (HF gpt2: 124,439,808 parameters) and Llama-2-7B (6,738,415,616).
    assert Gpt2Config().num_params(50257) == 124_439_808
    assert LlamaConfig().num_params(32000) == 6_738_415_616
    # 6 * matmul params (incl. LM head) + 12 * L * T * D (full attention map):
    gpt2_matmul = 12 * (4 * 768**2 + 8 * 768**2) + 50257 * 768
    assert Gpt2Config().flops_per_token(50257) == 6 * gpt2_matmul + 12 * 12 * 1024 * 768
    llama_matmul = 32 * (4 * 4096**2 + 3 * 4096 * 11008) + 32000 * 4096
    assert LlamaConfig().flops_per_token(32000) == 6 * llama_matmul + 12 * 32 * 2048 * 4096


def test_param_axes(family):
    _, model = family
    axes = model.param_axes()
    params = eqx.filter(model, eqx.is_array)
    assert jax.tree.structure(axes) == jax.tree.structure(params)
    for spec, leaf in zip(jax.tree.leaves(axes), jax.tree.leaves(params), strict=True):
        assert isinstance(spec, P) and len(spec) == leaf.ndim
        assert set(spec) <= LOGICAL
    assert axes.token_embeddings == P("vocab", "embed")
    assert axes.blocks.mlp.up_proj == P("layers", "embed", "mlp")
    # Works on an abstract (eval_shape) model as well.
    abstract = eqx.filter_eval_shape(lambda m: m, model)
    assert jax.tree.leaves(abstract.param_axes()) == jax.tree.leaves(axes)


def test_embedding_fields_named_for_weight_decay_exclusion(family):
    _, model = family
    names = named_params(model)
    assert [n for n in names if "embedding" in n] == [n for n in names if n.endswith("_embeddings")]
    assert "token_embeddings" in names


# ----------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class Wrapper:
    model: LmConfig = field(default_factory=Gpt2Config, help="model")


@pytest.mark.parametrize(
    "data, path, text",
    [
        ({"type": "gpt2", "hidden_dim": 100}, "model.hidden_dim", "divisible by num_heads (12)"),
        ({"type": "gpt2", "attn_pdrop": 1.5}, "model.attn_pdrop", "[0, 1)"),
        ({"type": "gpt2", "activation_function": "tanh"}, "model.activation_function", "gelu_new"),
        ({"type": "gpt2", "num_layers": 0}, "model.num_layers", "positive"),
        ({"type": "llama", "num_kv_heads": 5}, "model.num_kv_heads", "must divide num_heads (32)"),
        ({"type": "llama", "head_dim": 7}, "model.head_dim", "even"),
        ({"type": "llama", "hidden_dim": 100, "num_heads": 8, "num_kv_heads": 8}, "model.hidden_dim", "96 or 104"),
        ({"type": "llama", "rope_thetaa": 1.0}, "model.rope_thetaa", "rope_theta"),
        ({"type": "gpt3"}, "model.type", "gpt2"),
    ],
)
def test_config_errors_name_the_field(data, path, text):
    with pytest.raises(ConfigError) as info:
        from_dict(Wrapper, {"model": data})
    assert info.value.path == path
    assert text in info.value.message


def test_config_defaults_and_semantics():
    assert from_dict(Wrapper, {}).model == Gpt2Config()
    cfg = from_dict(Wrapper, {"model": {"type": "llama", "num_kv_heads": 8}}).model
    assert isinstance(cfg, LlamaConfig) and cfg.num_kv_heads == 8 and cfg.head_size == 128
    for klass in (Gpt2Config, LlamaConfig):
        semantic = {f.name: f.metadata["semantic"] for f in dataclasses.fields(klass)}
        # how, not what: the layer remat and Levanter's compute-plan keys (docs/training.md)
        how = {"gradient_checkpointing", "attn_backend", "flash_attention_block_size", "cross_entropy_block_size",
               "scan_layers"}
        assert {k for k, v in semantic.items() if not v} == how
        assert not how & set(to_dict(klass(), semantic_only=True))
    with pytest.raises(ConfigError, match="hidden_dim"):
        Gpt2Config(hidden_dim=770).validate()


# ----------------------------------------------------------------------------- Hugging Face parity


def _check_hf_parity(cfg: LmConfig):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = make(cfg)
    kwargs = hf_config(cfg, V)
    hf_cfg = transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager").eval()
    state = {k: torch.tensor(np.asarray(v, np.float32)) for k, v in to_hf_state_dict(model, cfg).items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)

    x = tokens(2, 12, seed=4)
    with torch.no_grad():
        ref = hf(torch.tensor(np.asarray(x), dtype=torch.long)).logits.numpy()
    ours = np.asarray(fwd(model, x))
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()
    # And back: HF weights -> our model reproduces every parameter.
    back = named_params(from_hf_state_dict(cfg, {k: v.numpy() for k, v in hf.state_dict().items()}, V))
    for name, value in named_params(model).items():
        np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(value), err_msg=name)


@pytest.mark.parametrize(
    "cfg",
    [LLAMA, dataclasses.replace(LLAMA, tie_word_embeddings=True, use_bias=True, head_dim=16, num_kv_heads=1, rope_theta=500.0)],
    ids=["gqa", "tied-bias-mqa-headdim"],
)
def test_llama_matches_hf(cfg):
    _check_hf_parity(cfg)


@pytest.mark.parametrize(
    "cfg",
    [GPT2, dataclasses.replace(GPT2, scale_attn_by_inverse_layer_idx=True, activation_function="gelu", upcast_attn=True)],
    ids=["default", "layer-scaled-gelu"],
)
def test_gpt2_matches_hf(cfg):
    _check_hf_parity(cfg)


# ----------------------------------------------------------------------------- KV cache


def test_greedy_decode_with_cache_matches_full_forward(family):
    _, model = family
    prompt, steps, max_len = tokens(2, 5, seed=5), 6, 12
    step = eqx.filter_jit(lambda m, tok, cache, pos: m.decode(tok, cache, pos))

    cache = model.init_cache(2, max_len)
    logits, cache = step(model, prompt, cache, jnp.int32(0))  # prefill
    seq, step_logits = prompt, [logits[:, -1]]
    for i in range(steps):
        nxt = jnp.argmax(step_logits[-1], axis=-1).astype(jnp.int32)[:, None]
        seq = jnp.concatenate([seq, nxt], axis=1)
        if i < steps - 1:
            logits, cache = step(model, nxt, cache, jnp.int32(seq.shape[1] - 1))
            step_logits.append(logits[:, 0])
    full = fwd(model, seq)
    p = prompt.shape[1]
    np.testing.assert_array_equal(np.asarray(jnp.argmax(full[:, p - 1 : -1], -1)), np.asarray(seq[:, p:]))
    close(jnp.stack(step_logits, axis=1), full[:, p - 1 : -1])
