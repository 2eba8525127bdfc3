"""The native CPU attention kernel (XLA FFI, built at first use) against jax.nn.dot_product_attention."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_blocked_attention import _inputs, _value_and_grads  # same random q/k/v and cotangent weights

from lm_pipeline.compute import plan_for
from lm_pipeline.kernels.cpu import native_attention
from lm_pipeline.kernels.cpu.blocked_attention import ATTENTION_RESIDUALS
from lm_pipeline.kernels.cpu.matmul import matmuls_and_attention_saveable
from lm_pipeline.kernels.cpu.native_attention import NativeAttentionUnavailable, native_causal_attention
from lm_pipeline.models.layers import attention, segment_mask

pytestmark = pytest.mark.skipif(
    not native_attention.available(), reason="native attention needs a C++ compiler (the XLA path is tested elsewhere)"
)


ISAS = native_attention.runnable_isas() if native_attention.available() else []
EPS32 = float(np.finfo(np.float32).eps)


def _reference64(q, k, v, w, scale):
    """Causal attention and the gradients of ``sum(attention * w)`` in float64 NumPy."""
    q, k, v, w = (np.asarray(x, np.float64) for x in (q, k, v, w))
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # query head i reads k/v head i // g
    s = np.einsum("btnh,bsnh->bnts", q, kr) * scale
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bnts,bsnh->btnh", p, vr)
    dp = np.einsum("btnh,bsnh->bnts", w, vr)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    per_head = lambda x: x.reshape(b, t, kh, g, h).sum(3)  # noqa: E731
    dq = np.einsum("bnts,bsnh->btnh", ds, kr) * scale
    dk = per_head(np.einsum("bnts,btnh->bsnh", ds, q) * scale)
    dv = per_head(np.einsum("bnts,btnh->bsnh", p, w))
    return out, (dq, dk, dv)


def _error(x, ref) -> float:
    """Largest absolute error relative to the reference's largest magnitude (absolute where the
    reference is all zeros: dq at a single position)."""
    return float(np.max(np.abs(np.asarray(x, np.float64) - ref)) / (np.max(np.abs(ref)) or 1.0))


_REFERENCES: dict[tuple, list] = {}


def _references(q, k, v, w, scale) -> list[tuple[np.ndarray, float]]:
    """(float64 value, XLA float32's error against it) for the output and dq, dk, dv; computed
    once per input (every ISA level is checked against the same references)."""
    key = (q.shape, k.shape, float(scale), float(jnp.sum(q)), float(jnp.sum(k)))
    if key not in _REFERENCES:
        out64, grads64 = _reference64(q, k, v, w, scale)
        ref = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=scale)  # noqa: E731
        xla = [jax.jit(ref)(q, k, v), *_value_and_grads(ref, q, k, v, w)[1]]
        _REFERENCES[key] = [(exact, _error(x, exact)) for x, exact in zip(xla, (out64, *grads64), strict=True)]
    return _REFERENCES[key]


def _assert_as_exact_as_xla(q, k, v, w, scale, isa, floor=16 * EPS32):
    """The kernel built for ``isa`` is within 2x of XLA's own float32 attention's error against a
    float64 reference (or within ``floor``), for the output and the three gradients."""
    new = lambda q, k, v: native_causal_attention(q, k, v, scale, isa=isa)  # noqa: E731
    ours = [jax.jit(new)(q, k, v), *_value_and_grads(new, q, k, v, w)[1]]
    for name, x, (exact, xla_err) in zip(("output", "dq", "dk", "dv"), ours, _references(q, k, v, w, scale), strict=True):
        ours_err = _error(x, exact)
        assert ours_err <= max(2 * xla_err, floor), f"{isa} {name}: error {ours_err:.2e}, XLA's {xla_err:.2e}"


def test_the_isa_levels_follow_the_cpu_flags():
    v2 = "cx16 lahf_lm popcnt sse4_1 sse4_2 ssse3"
    v3 = v2 + " avx avx2 bmi1 bmi2 f16c fma abm movbe xsave"
    v4 = v3 + " avx512f avx512bw avx512cd avx512dq avx512vl avx512_bf16 amx_tile amx_bf16"
    assert native_attention.runnable_isas(v4, "x86_64") == ["x86-64-v4", "x86-64-v3", "x86-64-v2", "x86-64"]
    assert native_attention.runnable_isas(v3, "x86_64") == ["x86-64-v3", "x86-64-v2", "x86-64"]
    # AVX-512 without all of v3's features (or a missing AVX-512 part) is not v4
    assert native_attention.runnable_isas(v4.replace(" fma", ""), "x86_64") == ["x86-64-v2", "x86-64"]
    assert native_attention.runnable_isas(v4.replace("avx512dq ", ""), "x86_64")[0] == "x86-64-v3"
    assert native_attention.runnable_isas("fpu sse sse2", "x86_64") == ["x86-64"]
    assert native_attention.runnable_isas("fp asimd", "aarch64") == ["generic"]


def test_the_named_level_must_be_one_the_cpu_runs(monkeypatch):
    monkeypatch.setenv(native_attention.ISA_ENV, "x86-64-v5")
    with pytest.raises(NativeAttentionUnavailable, match="LM_PIPELINE_NATIVE_ISA='x86-64-v5': this CPU runs"):
        native_attention.default_isa()
    monkeypatch.setenv(native_attention.ISA_ENV, ISAS[-1])
    assert native_attention.default_isa() == ISAS[-1]


SHAPES = [
    (2, 256, 4, 4, 64),  # 4 full query blocks, head size a multiple of 16
    (3, 200, 4, 2, 24),  # last block short; GQA; head size 16 + 8
    (2, 130, 4, 1, 20),  # multi-query; head size with a scalar tail
    (1, 5, 2, 2, 8),  # fewer rows than the 6-row kernel
    (2, 1, 3, 3, 16),  # a single position
]
# The level the CPU runs by default takes every shape; each other level the CPU can run takes the
# two that reach every code path of the kernel (full and short blocks, the vector and scalar tails).
CASES = [(ISAS[0], *shape) for shape in SHAPES] + [(isa, *SHAPES[i]) for isa in ISAS[1:] for i in (1, 2)] if ISAS else []


@pytest.mark.parametrize(("isa", "b", "t", "n", "kh", "h"), CASES)
def test_every_isa_level_is_as_exact_as_xla_against_float64(isa, b, t, n, kh, h):
    q, k, v, w = _inputs(b, t, n, kh, h)
    _assert_as_exact_as_xla(q, k, v, w, 0.3, isa)


@pytest.mark.parametrize("isa", ISAS)
def test_large_scores_stay_finite_and_exact(isa):
    """Logits in the hundreds: the kernel's exp and its max-subtraction keep the softmax as exact
    as XLA's. A float32 score s carries a rounding error of up to eps * |s| (~3e-5 here), which
    moves each probability by as much relative to itself, whoever computes it: the bound is
    XLA's error or that floor."""
    q, k, v, w = _inputs(1, 96, 2, 2, 16)
    q = q * 40.0
    out = jax.jit(lambda q, k, v: native_causal_attention(q, k, v, 1.0, isa=isa))(q, k, v)
    assert bool(jnp.all(jnp.isfinite(out)))
    max_score = float(np.max(np.abs(np.einsum("bthd,bshd->bhts", np.asarray(q), np.asarray(k)))))
    assert max_score > 100.0
    _assert_as_exact_as_xla(q, k, v, w, 1.0, isa, floor=EPS32 * max_score)


def test_the_default_level_is_the_best_the_cpu_runs_and_agrees_with_xla():
    assert native_attention.load() == ISAS[0]
    q, k, v, _ = _inputs(2, 64, 4, 2, 16)
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    np.testing.assert_allclose(native_causal_attention(q, k, v, 0.3), ref, atol=2e-6, rtol=1e-5)


def test_traced_scale_gets_no_gradient_and_vmap_runs_per_example():
    q, k, v, w = _inputs(2, 70, 2, 2, 8)
    ds = jax.grad(lambda s: jnp.sum(native_causal_attention(q, k, v, s) * w))(jnp.float32(0.5))
    assert float(ds) == 0.0
    batched = jax.vmap(lambda q, k, v: native_causal_attention(q[None], k[None], v[None], 0.5)[0])(q, k, v)
    np.testing.assert_allclose(batched, native_causal_attention(q, k, v, 0.5), atol=1e-6)


def test_attention_takes_the_native_kernel_on_one_cpu_device_in_every_dtype():
    q, k, v, _ = _inputs(2, 64, 4, 2, 16)
    plan = plan_for("cpu", jnp.float32, num_devices=1)
    assert plan.attention == "cpu_native"
    assert plan_for("cpu", jnp.bfloat16, num_devices=1).attention == "cpu_native"

    def lowered(fn, *args):
        return jax.jit(fn).lower(*args).as_text()

    plain = lowered(lambda q, k, v: attention(q, k, v, None, scale=0.25, causal=True, plan=plan), q, k, v)
    assert "lm_pipeline_causal_attention_fwd" in plain
    # bf16 inputs: the kernel computes in f32 and returns bf16, the values of XLA's f32 attention
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    bf16 = lowered(lambda q, k, v: attention(q, k, v, None, scale=0.25, plan=plan), *low)
    assert "lm_pipeline_causal_attention_fwd" in bf16
    out = jax.jit(lambda q, k, v: attention(q, k, v, None, scale=0.25, plan=plan))(*low)
    in_f32 = native_causal_attention(*(x.astype(jnp.float32) for x in low), 0.25)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(in_f32.astype(jnp.bfloat16), np.float32))
    # a packing mask, several devices or LM_PIPELINE_ATTENTION=blocked/xla keep XLA ops
    mask = segment_mask(jnp.ones((2, 64), jnp.int32))
    masked = lowered(lambda q, k, v: attention(q, k, v, mask, scale=0.25, causal=True, plan=plan), q, k, v)
    others = [
        lowered(lambda q, k, v, p=p: attention(q, k, v, None, scale=0.25, plan=p), q, k, v)
        for p in (plan_for("cpu", jnp.float32, num_devices=2), plan_for("cpu", jnp.float32, attention="blocked"),
                  plan_for("cpu", jnp.float32, attention="xla"))
    ]
    for text in (masked, *others):
        assert "lm_pipeline_causal_attention" not in text
    with pytest.raises(ValueError, match="single CPU device"):
        plan_for("cpu", jnp.float32, num_devices=2, attention="native")


def test_remat_policy_keeps_the_kernels_output_and_lse():
    """Under the layer remat policy the backward pass reuses the forward's residuals: the
    forward kernel runs once per layer, not again inside the backward pass."""
    q, k, v, w = _inputs(1, 64, 2, 2, 16)

    def layer(q, k, v):
        return attention(q, k, v, None, scale=0.25, causal=True, plan=plan_for("cpu", jnp.float32))

    policy = matmuls_and_attention_saveable()
    body = jax.checkpoint(layer, policy=policy)
    hlo = jax.jit(jax.grad(lambda q, k, v: jnp.sum(body(q, k, v) * w), argnums=(0, 1, 2))).lower(q, k, v).as_text()
    assert hlo.count("lm_pipeline_causal_attention_fwd") == 1
    assert hlo.count("lm_pipeline_causal_attention_bwd") == 1
    fwd_jaxpr = jax.make_jaxpr(lambda q, k, v: native_attention._attention_of(native_attention.load()).fwd(q, k, v, jnp.float32(0.25)))(q, k, v)
    names = {str(e.params.get("name")) for e in fwd_jaxpr.eqns if e.primitive.name == "name"}
    assert set(ATTENTION_RESIDUALS) <= names


def test_a_missing_compiler_falls_back_to_the_blocked_attention_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(native_attention, "_state", {})
    monkeypatch.setattr(native_attention, "_compiler", lambda: None)
    q, k, v, _ = _inputs(1, 32, 2, 2, 8)
    with caplog.at_level(logging.WARNING, logger="lm_pipeline.kernels.cpu.native_attention"):
        plan = plan_for("cpu", jnp.float32, num_devices=1)
        text = jax.jit(lambda q, k, v: attention(q, k, v, None, scale=0.25, plan=plan)).lower(q, k, v).as_text()
    assert plan.attention == "cpu_blocked"
    assert "lm_pipeline_causal_attention" not in text
    assert "no C++ compiler found" in caplog.text
    with pytest.raises(NativeAttentionUnavailable, match="no C\\+\\+ compiler"):
        native_causal_attention(q, k, v, 0.25)


def test_a_failing_build_names_the_command_and_leaves_no_library(monkeypatch, tmp_path):
    """A compiler that fails: the error carries its output, nothing half-written is left in the
    cache directory, and the next process can still build."""
    fake = tmp_path / "fake-cxx"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\necho 'boom: bad flag' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv(native_attention.DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(native_attention, "_compiler", lambda: str(fake))
    with pytest.raises(NativeAttentionUnavailable, match="boom: bad flag"):
        native_attention.build()
    assert list((tmp_path / "cache").iterdir()) == []


def test_the_build_is_cached_per_source_and_written_atomically(monkeypatch, tmp_path):
    monkeypatch.setenv(native_attention.DIR_ENV, str(tmp_path))
    path = native_attention.build()
    assert path.parent == tmp_path and path.name.startswith("cpu_attention-") and path.suffix == ".so"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary files left
    mtime = path.stat().st_mtime_ns
    assert native_attention.build() == path and path.stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert path.name.startswith(f"cpu_attention-{ISAS[0]}-")  # keyed by the level, not the host's flags
    if len(ISAS) > 1:  # each level is a library of its own
        assert native_attention.build(ISAS[-1]) not in (path, None) and len(list(tmp_path.iterdir())) == 2


def test_negative_scale_matches_too():
    q, k, v, _ = _inputs(1, 40, 2, 2, 8)
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=-0.7)
    np.testing.assert_allclose(native_causal_attention(q, k, v, -0.7), ref, atol=2e-6, rtol=1e-5)


def test_a_compiler_that_cannot_target_the_best_level_falls_back_to_the_next(monkeypatch, tmp_path, caplog):
    """A compiler that rejects the CPU's best level (an old GCC without x86-64-v4, say): the
    default build falls back to the next level down, with a warning naming both, and runs."""
    if len(ISAS) < 2:
        pytest.skip("this CPU runs one level only")
    real = native_attention._compiler()
    picky = tmp_path / "picky-cxx"
    picky.write_text(f"#!/bin/sh\nfor a in \"$@\"; do [ \"$a\" = -march={ISAS[0]} ] && "
                     f"{{ echo 'unknown arch {ISAS[0]}' >&2; exit 1; }}; done\nexec {real} \"$@\"\n")
    picky.chmod(0o755)
    monkeypatch.setenv(native_attention.DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(native_attention, "_compiler", lambda: str(picky))
    monkeypatch.setattr(native_attention, "_state", {})
    with caplog.at_level(logging.WARNING, logger="lm_pipeline.kernels.cpu.native_attention"):
        assert native_attention.load() == ISAS[1]
    assert f"built for {ISAS[1]}" in caplog.text and f"unknown arch {ISAS[0]}" in caplog.text
    assert [p.name.startswith(f"cpu_attention-{ISAS[1]}-") for p in (tmp_path / "cache").iterdir()] == [True]
    q, k, v, _ = _inputs(1, 24, 2, 2, 8)
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    np.testing.assert_allclose(native_causal_attention(q, k, v, 0.5), ref, atol=2e-6, rtol=1e-5)
