"""How a step computes, decided once: the one seam between the models and the platform.

A :class:`ComputePlan` says which attention, matmul, loss and layer-loop forms a computation
uses. :func:`plan_for_mesh` decides it once from the mesh the step runs on (its platform and
size), the compute dtype and ``$LM_PIPELINE_ATTENTION``; the trainer, the evaluator and text
generation pass it explicitly to the models (``model(tokens, plan=...)``), which call
:meth:`ComputePlan.dense`, :meth:`ComputePlan.causal_attention` and
:meth:`ComputePlan.lm_logits` instead of asking which backend they run on. A model called
without a plan computes with :data:`REFERENCE`, plain XLA operations that run anywhere.

Every choice gives the same values up to float rounding; only speed and memory differ. The
CPU kernels live in :mod:`lm_pipeline.kernels.cpu` and are imported here and nowhere else:
removing that package means removing the ``cpu_*`` choices below, nothing in the models.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

F32 = jnp.float32
LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
ATTENTION_ENV = "LM_PIPELINE_ATTENTION"
ATTENTION_CHOICES = ("auto", "xla", "cudnn", "native", "blocked")

AttentionKind = Literal["xla", "cudnn", "cpu_blocked", "cpu_native"]

LEVANTER_BACKENDS = ("default", "nvte", "splash", "jax_flash", "vanilla")
"""Levanter's ``model.attn_backend`` values (its ``AttentionBackend``), mapped by :func:`levanter_attention`."""


@dataclass(frozen=True)
class ComputeHints:
    """What a config asks of the plan about *how* to compute (Levanter's model keys; none changes
    results beyond float rounding, none enters a fingerprint). None = the plan's own choice.

    Attributes:
        attn_backend: Levanter's attention backend (:data:`LEVANTER_BACKENDS`), mapped per platform
            by :func:`levanter_attention`.
        attention_block: query rows per block of the blocked attention (Levanter's
            ``flash_attention_block_size``).
        head_chunk_rows: token rows per chunk of the fused LM head + cross-entropy (Levanter's
            ``cross_entropy_block_size``).
        scan_layers: True: the layer stack is always a scan; False: always unrolled.
    """

    attn_backend: str | None = None
    attention_block: int | None = None
    head_chunk_rows: int | None = None
    scan_layers: bool | None = None


NO_HINTS = ComputeHints()


def hints_from(model_config: Any) -> ComputeHints:
    """The :class:`ComputeHints` of a model config (its Levanter keys ``attn_backend``,
    ``flash_attention_block_size``, ``cross_entropy_block_size``, ``scan_layers``; absent = None)."""
    if model_config is None:
        return NO_HINTS
    get = lambda name: getattr(model_config, name, None)  # noqa: E731
    return ComputeHints(get("attn_backend"), get("flash_attention_block_size"), get("cross_entropy_block_size"),
                        get("scan_layers"))


def _say_once(*what: str) -> None:
    """Log ``what[-1]`` once per process for the key ``what[:-1]`` (:func:`lm_pipeline.levanter.note`)."""
    from lm_pipeline.levanter import note

    note("compute:" + "|".join(what[:-1]), what[-1], logger=log)


def levanter_attention(backend: str, platform: str) -> str:
    """The :data:`ATTENTION_CHOICES` entry a Levanter ``attn_backend`` becomes on ``platform``.

    ``default`` -> ``auto`` (the plan's own choice); ``vanilla`` (plain dot-product attention) ->
    ``xla``; ``jax_flash`` (blockwise flash attention in JAX) -> ``blocked`` on CPU, ``cudnn`` on GPU
    (cuDNN's flash attention where it applies, else XLA's), ``xla`` on TPU; ``nvte`` (Transformer
    Engine's fused attention, NVIDIA GPUs) -> ``cudnn`` on GPU; ``splash`` (the TPU kernel) -> ``xla``
    on TPU. ``nvte`` and ``splash`` elsewhere fall back to ``auto`` with one log line. Never strict:
    a kernel that does not apply to a call falls back as ``auto`` would.
    """
    table = {
        "default": {},
        "vanilla": {"cpu": "xla", "gpu": "xla", "tpu": "xla"},
        "jax_flash": {"cpu": "blocked", "gpu": "cudnn", "tpu": "xla"},
        "nvte": {"gpu": "cudnn"},
        "splash": {"tpu": "xla"},
    }
    if backend not in table:
        raise ValueError(f"model.attn_backend must be one of {', '.join(LEVANTER_BACKENDS)}; got {backend!r}")
    choice = table[backend].get(platform)
    if choice is None:
        if backend != "default":
            _say_once("attn_backend", backend, platform,
                      f"model.attn_backend: {backend} has no kernel on {platform}: the compute plan's own attention "
                      "is used")
        return "auto"
    return choice

CPU_UNROLL_MAX_LAYERS = 8
"""On CPU, a low-precision (bf16) stack of at most this many layers that is neither checkpointed
nor under a remat policy is unrolled: XLA:CPU computes bf16 elementwise ops in f32, and in a scan
every saved residual goes through a convert into its stacked buffer and back."""

ACCELERATOR_UNROLL_MAX_LAYERS = 48
"""On GPU/TPU, a stack of at most this many layers that is not checkpointed is unrolled: a scan
slices each layer's parameters out of the stacked arrays and writes each saved activation and
gradient into stacked buffers (``docs/benchmarks.md``)."""

VOCAB_PAD_MULTIPLE = 128
"""On accelerators the LM head computes with its vocabulary padded to a multiple of this (zero
rows, logits sliced back): cuBLAS picks slow kernels for odd widths such as GPT-2's 50257."""


@dataclass(frozen=True)
class ComputePlan:
    """How the model and the step compute. Hashable: a static argument of jitted functions.

    Attributes:
        platform: the mesh's platform (``cpu``, ``gpu``, ``tpu``), or ``any`` for :data:`REFERENCE`.
        attention: causal self-attention's form: ``xla`` (``jax.nn.dot_product_attention``),
            ``cudnn`` (cuDNN's flash attention where it applies), ``cpu_blocked`` (query blocks,
            flash-style backward) or ``cpu_native`` (the C++ kernel where it applies, else
            blocked).
        strict_attention: the attention was asked for by name (``$LM_PIPELINE_ATTENTION``):
            fail where it cannot apply instead of falling back.
        matmul: ``xla`` (einsum) or ``cpu`` (a weight gradient XLA:CPU computes fast).
        native_transpose: with ``matmul: cpu``, the weight gradients' operand is transposed by
            the native library's custom call (:func:`lm_pipeline.kernels.cpu.matmul.xt_g`): a
            plain product XLA cannot refold, bf16 operands multiplied as bf16. Set on one CPU
            device where the library builds (the SPMD partitioner cannot shard a custom call).
        loss: ``logits`` (the model's logits, then cross-entropy) or ``cpu_fused_head`` (head and
            cross-entropy in chunks, no ``[B, T, V]`` logits).
        remat: ``none``, or ``cpu_dots``: layers the model does not checkpoint keep only matmul
            and attention outputs for the backward pass and recompute the elementwise work.
        unroll_max_layers: a stack of at most this many layers that is neither checkpointed nor
            under a remat policy is unrolled instead of scanned (0: always scanned).
        vocab_pad_multiple: the LM head pads the vocabulary to a multiple of this (1: no padding).
        f16_attention_in_f32: attention of float16 inputs computes in float32 (XLA:CPU has no
            f16 x f16 -> f32 dot).
        attention_block: query rows per block of the blocked attention (0: its own rule,
            :func:`~lm_pipeline.kernels.cpu.blocked_attention.num_query_blocks`).
        head_chunk_rows: token rows per chunk of the fused head + cross-entropy (0: its own,
            :data:`~lm_pipeline.kernels.cpu.fused_head_loss.HEAD_CHUNK_ROWS`).
        layer_loop: ``auto`` (:meth:`unroll`'s rule), ``scan`` (never unrolled) or ``unroll``
            (always, also under a remat policy or checkpointing).
        fp8: projections multiply fp8 values (:func:`lm_pipeline.fp8.fp8_dense`; training with
            ``trainer.quantization.fp8`` on a GPU with fp8 matmuls). The LM head and attention
            keep the compute dtype.
        matmul_operands: None, or the dtype the projections' and the LM head's operands are
            rounded to (``trainer.mp``'s ``m=``): products accumulate in float32 and return in
            the compute dtype. Attention and the elementwise work keep the compute dtype.
        blas: with ``matmul: cpu``, float32 products (projections, LM head, their gradients) go
            to oneMKL's sgemm through the native library
            (:func:`lm_pipeline.kernels.cpu.matmul.gemm`). Set on one CPU device of an Intel CPU
            where oneMKL and the native library load (:func:`blas_choice`).
    """

    platform: str = "any"
    attention: AttentionKind = "xla"
    strict_attention: bool = False
    matmul: Literal["xla", "cpu"] = "xla"
    native_transpose: bool = False
    loss: Literal["logits", "cpu_fused_head"] = "logits"
    remat: Literal["none", "cpu_dots"] = "none"
    unroll_max_layers: int = 0
    vocab_pad_multiple: int = 1
    f16_attention_in_f32: bool = True
    attention_block: int = 0
    head_chunk_rows: int = 0
    layer_loop: Literal["auto", "scan", "unroll"] = "auto"
    fp8: bool = False
    matmul_operands: Any = None
    blas: bool = False

    # --- what the models call -----------------------------------------------------------------

    def dense(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """A projection ``x [..., K] @ w [K, N] -> [..., N]``."""
        if self.fp8:
            from lm_pipeline.fp8 import fp8_dense

            return fp8_dense(x, w)
        if self.matmul == "cpu":
            from lm_pipeline.kernels.cpu import matmul

            return matmul.dense(x, w, self.matmul_operands, self.native_transpose, self.blas)
        return _einsum_in("...k,kn->...n", x, w, self.matmul_operands)

    def add_bias(self, y: jax.Array, b: jax.Array | None) -> jax.Array:
        """``y + b`` with ``b`` broadcast over ``y``'s leading axes (``y`` itself if ``b`` is None).

        On CPU a bf16/f16 ``y`` gets its bias gradient summed in float32 (XLA:CPU's own
        low-precision reduction is a slow windowed loop that rounds the sum to bf16).
        """
        if b is None:
            return y
        if self.matmul == "cpu" and y.dtype in LOW_PRECISION:
            from lm_pipeline.kernels.cpu import matmul

            return matmul.add_bias(y, b)
        return y + b

    def lm_logits(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """Logits ``x [B, T, D] @ w [V, D]ᵀ -> [B, T, V]`` in the inputs' dtype."""
        pad = -w.shape[0] % self.vocab_pad_multiple
        wp = w if pad == 0 else jnp.pad(w, ((0, pad), (0, 0)))
        if self.matmul == "cpu":
            from lm_pipeline.kernels.cpu import matmul

            logits = matmul.lm_logits(x, wp, self.matmul_operands, self.native_transpose, self.blas)
        else:
            logits = _einsum_in("btd,vd->btv", x, wp, self.matmul_operands)
        return logits if pad == 0 else logits[..., : w.shape[0]]

    def causal_attention(
        self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, scale: float | jax.Array
    ) -> jax.Array:
        """Causal self-attention, q ``[B, T, N, H]``, k/v ``[B, T, K, H]`` -> ``[B, T, N, H]``.

        ``mask``: None (plain causal) or a boolean mask broadcastable to ``[B, 1, T, T]`` that is
        itself causal (:func:`lm_pipeline.models.layers.segment_mask`).
        """
        if self.attention == "cpu_native" and mask is None:
            from lm_pipeline.kernels.cpu import native_attention

            if q.dtype == F32 and k.dtype == F32 and v.dtype == F32:
                return native_attention.native_causal_attention(q, k, v, scale)
            if q.dtype in LOW_PRECISION and k.dtype == q.dtype and v.dtype == q.dtype:
                # bf16/f16 inputs: the kernel computes in float32 (as XLA:CPU's own attention
                # does inside its fusions); the output returns in the inputs' dtype.
                out = native_attention.native_causal_attention(q.astype(F32), k.astype(F32), v.astype(F32), scale)
                return out.astype(q.dtype)
            if self.strict_attention:
                raise ValueError(
                    f"{ATTENTION_ENV}=native: the native kernel takes float32, bfloat16 or float16 inputs of "
                    f"one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}"
                )
        if self.attention in ("cpu_native", "cpu_blocked"):
            from lm_pipeline.kernels.cpu import blocked_attention

            # A single query block in a low-precision dtype has nothing to skip, and XLA's own
            # bf16 path measured faster there.
            block = self.attention_block or None
            if q.dtype == F32 or blocked_attention.num_query_blocks(q.shape[1], block) > 1:
                return blocked_attention.blocked_causal_attention(q, k, v, mask, scale, block=block)
        if self.attention == "cudnn" and mask is None and (self.strict_attention or _cudnn_applies(q)):
            try:
                return jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=scale, implementation="cudnn")
            except (NotImplementedError, RuntimeError, ValueError):
                if self.strict_attention:
                    raise
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=mask is None, scale=scale)

    def remat_policy(self) -> Callable[..., bool] | None:
        """The ``jax.checkpoint`` policy for layers the model does not checkpoint, or None."""
        if self.remat == "cpu_dots":
            from lm_pipeline.kernels.cpu import matmul

            return matmul.matmuls_and_attention_saveable()
        return None

    def unroll(self, num_layers: int) -> bool:
        """Whether a plain (not checkpointed, no remat policy) stack of ``num_layers`` is unrolled."""
        if self.layer_loop != "auto":
            return self.layer_loop == "unroll" and num_layers > 0
        return 0 < num_layers <= self.unroll_max_layers

    def unroll_rematerialized(self, num_layers: int) -> bool:
        """Whether a checkpointed (or remat-policy) stack of ``num_layers`` is unrolled: only when
        asked (``layer_loop: unroll``, Levanter's ``scan_layers: false``)."""
        return self.layer_loop == "unroll" and num_layers > 0

    # --- what the loss calls ------------------------------------------------------------------

    def head_xent_sum(self, hidden: jax.Array, head: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
        """The ``cpu_fused_head`` loss: ``sum(mask * xent(hidden @ headᵀ, targets))`` in f32."""
        from lm_pipeline.kernels.cpu import fused_head_loss

        return fused_head_loss.fused_head_xent_sum(hidden, head, targets, mask, chunk_rows=self.head_chunk_rows or None,
                                                   operands=self.matmul_operands, native=self.native_transpose,
                                                   blas=self.blas)


def _einsum_in(spec: str, a: jax.Array, b: jax.Array, operands: Any) -> jax.Array:
    """``einsum(spec, a, b)`` for ``spec`` ``...k,kn->...n`` or ``btd,vd->btv``; with ``operands``
    (a dtype) through :func:`_rounded_matmul`."""
    if operands is None:
        return jnp.einsum(spec, a, b)
    return _rounded_matmul(a, b if spec == "...k,kn->...n" else b.T, operands)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rounded_matmul(x: jax.Array, w: jax.Array, operands: Any) -> jax.Array:
    """``x [..., K] @ w [K, N]`` of operands rounded to ``operands``, accumulated in float32, in
    ``x``'s dtype; its two gradient products round the cotangent too and return float32 sums in
    the inputs' dtypes (as :func:`lm_pipeline.kernels.cpu.matmul.matmul` on CPU)."""
    return jnp.einsum("...k,kn->...n", x.astype(operands), w.astype(operands),
                      preferred_element_type=jnp.float32).astype(x.dtype)


def _rounded_matmul_fwd(x, w, operands):
    return _rounded_matmul(x, w, operands), (x, w)


def _rounded_matmul_bwd(operands, res, g):
    x, w = res
    gl, f32 = g.astype(operands), jnp.float32
    dx = jnp.einsum("...n,kn->...k", gl, w.astype(operands), preferred_element_type=f32).astype(x.dtype)
    dw = jnp.einsum("...k,...n->kn", x.astype(operands), gl, preferred_element_type=f32).astype(w.dtype)
    return dx, dw


_rounded_matmul.defvjp(_rounded_matmul_fwd, _rounded_matmul_bwd)


REFERENCE = ComputePlan()
"""Plain XLA operations on any platform: what a model computes when called without a plan."""


def _cudnn_applies(q: jax.Array) -> bool:
    """cuDNN's fused kernels cover bf16/f16 with a head size that is a multiple of 8 up to 128."""
    head = q.shape[-1]
    return q.dtype in (jnp.bfloat16, jnp.float16) and head % 8 == 0 and head <= 128


def attention_choice(choice: str | None = None) -> str:
    """``choice``, else ``$LM_PIPELINE_ATTENTION``, else ``auto``; validated."""
    name = "attention" if choice is not None else f"${ATTENTION_ENV}"
    if choice is None:
        choice = os.environ.get(ATTENTION_ENV, "").strip().lower() or "auto"
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"{name} must be one of {', '.join(ATTENTION_CHOICES)}; got {choice!r}")
    return choice


def plan_for(
    platform: str, compute_dtype: Any, *, num_devices: int = 1, loss_scaling: bool = False, attention: str | None = None,
    hints: ComputeHints = NO_HINTS,
) -> ComputePlan:
    """The plan for a mesh of ``num_devices`` devices of ``platform`` computing in ``compute_dtype``.

    ``loss_scaling``: f16 dynamic loss scaling is on (the fused head's cotangent would be cast to
    f16 before it is scaled, so the logits path is kept). ``attention``: one of
    :data:`ATTENTION_CHOICES`, default ``$LM_PIPELINE_ATTENTION`` or ``auto``; a named choice
    (argument or variable) fails where it cannot apply. ``hints``: the config's Levanter keys
    (:class:`ComputeHints`): its ``attn_backend`` applies when ``attention`` resolves to ``auto``
    (the variable overrides the config), never strictly; block sizes and the layer loop apply to
    whatever form the plan takes.
    """
    plan = _plan_for(platform, compute_dtype, num_devices, loss_scaling, attention, hints)
    if hints.attention_block:
        if plan.attention == "cpu_blocked":
            plan = dataclasses.replace(plan, attention_block=int(hints.attention_block))
        else:
            _say_once("flash_attention_block_size", plan.attention,
                      f"model.flash_attention_block_size applies to the blocked attention; this plan's attention is "
                      f"{plan.attention} (no blocks): not used")
    if hints.head_chunk_rows:
        if plan.loss == "cpu_fused_head":
            plan = dataclasses.replace(plan, head_chunk_rows=int(hints.head_chunk_rows))
        else:
            _say_once("cross_entropy_block_size", plan.platform,
                      f"model.cross_entropy_block_size applies to the fused LM head + cross-entropy; this plan computes "
                      f"full logits on {plan.platform}: not used")
    if hints.scan_layers is not None:
        plan = dataclasses.replace(plan, layer_loop="scan" if hints.scan_layers else "unroll")
    return plan


def _plan_for(platform: str, compute_dtype: Any, num_devices: int, loss_scaling: bool, attention: str | None,
              hints: ComputeHints) -> ComputePlan:
    choice = attention_choice(attention)
    strict = choice != "auto"
    if choice == "auto" and hints.attn_backend is not None:
        choice = levanter_attention(hints.attn_backend, platform)
    elif strict and hints.attn_backend not in (None, "default"):
        _say_once("attn_backend-overridden", choice,
                  f"model.attn_backend: {hints.attn_backend} is overridden by {ATTENTION_ENV}={choice}")
    if choice == "cudnn" and platform != "gpu":
        raise ValueError(f"{ATTENTION_ENV}=cudnn needs a GPU; this mesh's platform is {platform}")
    f32 = jnp.dtype(compute_dtype) == jnp.float32
    if platform == "cpu":
        return ComputePlan(
            platform="cpu",
            attention=_cpu_attention(choice, num_devices),
            strict_attention=strict and choice == "native",
            matmul="cpu",
            native_transpose=num_devices == 1 and _native_library(),
            blas=f32 and num_devices == 1 and _blas_gemm(),
            loss="logits" if loss_scaling else "cpu_fused_head",
            remat="cpu_dots" if f32 else "none",
            unroll_max_layers=0 if f32 else CPU_UNROLL_MAX_LAYERS,
            vocab_pad_multiple=1,
            f16_attention_in_f32=True,
        )
    if choice in ("native", "blocked"):
        raise ValueError(f"{ATTENTION_ENV}={choice} is a CPU kernel; this mesh's platform is {platform}")
    low_precision = jnp.dtype(compute_dtype) in (jnp.bfloat16, jnp.float16)
    cudnn = platform == "gpu" and (choice == "cudnn" or (choice == "auto" and low_precision))
    return ComputePlan(
        platform=platform,
        attention="cudnn" if cudnn else "xla",
        strict_attention=strict and choice == "cudnn",
        unroll_max_layers=ACCELERATOR_UNROLL_MAX_LAYERS,
        vocab_pad_multiple=VOCAB_PAD_MULTIPLE,
        f16_attention_in_f32=False,
    )


BLAS_ENV = "LM_PIPELINE_BLAS"
BLAS_CHOICES = ("auto", "mkl", "xla")


def blas_choice(environ: dict[str, str] | None = None) -> str:
    """``$LM_PIPELINE_BLAS`` (``auto``, ``mkl`` or ``xla``; default ``auto``), validated."""
    value = (os.environ if environ is None else environ).get(BLAS_ENV, "").strip().lower() or "auto"
    if value not in BLAS_CHOICES:
        raise ValueError(f"${BLAS_ENV} must be one of {', '.join(BLAS_CHOICES)}; got {value!r}")
    return value


def _blas_gemm() -> bool:
    """Whether float32 products on one CPU device go to oneMKL's sgemm: ``auto`` on Intel CPUs
    (on them it is faster than XLA:CPU's kernels; ``docs/benchmarks.md``), ``mkl`` anywhere, each
    only where oneMKL and the native library load; ``xla`` never."""
    from lm_pipeline.hostinfo import cpu_vendor
    from lm_pipeline.kernels.cpu import blas

    choice = blas_choice()
    if choice == "xla" or (choice == "auto" and cpu_vendor() != "GenuineIntel"):
        return False
    if not (_native_library() and blas.available()):
        if choice == "mkl":
            raise ValueError(f"${BLAS_ENV}=mkl: oneMKL or the native CPU library does not load here")
        return False
    return True


def _native_library() -> bool:
    """Whether the native CPU library (attention, transpose) builds and loads here."""
    from lm_pipeline.kernels.cpu import native_attention

    return native_attention.available()


def _cpu_attention(choice: str, num_devices: int) -> AttentionKind:
    """The native kernel takes plain causal attention on one device (the SPMD partitioner cannot
    shard its opaque custom call), computing in float32 whatever the compute dtype; the blocked
    path takes the rest."""
    from lm_pipeline.kernels.cpu import native_attention

    if choice == "xla":
        return "xla"
    if choice == "native":
        if num_devices != 1:
            raise ValueError(
                f"{ATTENTION_ENV}=native: the native kernel takes causal self-attention on a single CPU device; "
                f"got {num_devices} devices"
            )
        native_attention.load()  # raises NativeAttentionUnavailable with the reason
        return "cpu_native"
    if choice == "auto" and num_devices == 1 and native_attention.available():
        return "cpu_native"
    return "cpu_blocked"


def one_platform(devices: Any) -> str:
    """The one platform of ``devices`` (a mesh or a step never mixes platforms)."""
    platforms = {d.platform for d in devices}
    if len(platforms) != 1:
        raise ValueError(f"devices must share one platform; got {sorted(platforms)}")
    return platforms.pop()


def mesh_platform(mesh: jax.sharding.Mesh) -> str:
    """The one platform of ``mesh``'s devices."""
    return one_platform(mesh.devices.flat)


def plan_for_mesh(
    mesh: jax.sharding.Mesh, compute_dtype: Any, *, loss_scaling: bool = False, attention: str | None = None,
    hints: ComputeHints = NO_HINTS,
) -> ComputePlan:
    """:func:`plan_for` the platform and size of ``mesh``."""
    return plan_for(
        mesh_platform(mesh), compute_dtype, num_devices=mesh.size, loss_scaling=loss_scaling, attention=attention,
        hints=hints,
    )


def plan_for_devices(devices: Any, compute_dtype: Any, *, attention: str | None = None,
                     hints: ComputeHints = NO_HINTS) -> ComputePlan:
    """:func:`plan_for` a list of devices (e.g. ``jax.devices()[:1]`` for a one-device evaluation)."""
    devices = list(devices)
    return plan_for(one_platform(devices), compute_dtype, num_devices=len(devices), attention=attention, hints=hints)


def plan_for_params(params: Any) -> ComputePlan:
    """The plan for one device of the default backend computing in the dtype of ``params``'s
    first floating-point array (a model called outside a mesh: evaluation, generation), with the
    hints of the model's config (``params.config``, when it is a model: :func:`hints_from`)."""
    dtype = next(x.dtype for x in jax.tree.leaves(params) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact))
    return plan_for_devices(jax.devices()[:1], dtype, hints=hints_from(getattr(params, "config", None)))
