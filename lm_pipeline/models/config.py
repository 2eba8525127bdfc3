"""Model configs: the :class:`LmConfig` family (``type: gpt2 | llama``), its members, and the
helpers their ``validate()`` uses. Light: no JAX or Equinox until :meth:`LmConfig.build`.

Each config also answers sizing questions without building a model (:meth:`LmConfig.num_params`,
:meth:`LmConfig.flops_per_token`). Importing this module registers every family member.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from lm_pipeline.levanter import MODEL_COMPUTE_KEYS as _HOW
from lm_pipeline.schema import Choice, ConfigError, field

if TYPE_CHECKING:
    import jax

    from lm_pipeline.models.base import LmModel
    from lm_pipeline.models.gpt2 import Gpt2Model
    from lm_pipeline.models.llama import LlamaModel


class LmConfig(Choice):
    """Family of model configs; ``type: gpt2`` or ``type: llama``."""

    default_type: ClassVar[str] = "gpt2"
    # Members are frozen dataclasses with at least: type, seq_len.

    def build(self, vocab_size: int, *, key: jax.Array) -> LmModel:
        """A freshly initialised model with f32 parameters."""
        raise NotImplementedError

    def flops_per_token(self, vocab_size: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), attention included."""
        raise NotImplementedError

    def num_params(self, vocab_size: int) -> int:
        """Number of parameters (every array element, embeddings included)."""
        raise NotImplementedError


# Validation helpers for family members' ``validate()``.


def require_positive(cfg: Any, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value <= 0:
            raise ConfigError(name, f"must be positive, got {value!r}")


def require_probability(cfg: Any, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not 0.0 <= value < 1.0:
            raise ConfigError(name, f"must be in [0, 1), got {value!r}")


def require_activation(cfg: Any, name: str = "activation_function") -> None:
    valid = ("gelu", "gelu_new", "relu", "silu")  # the keys of layers.ACTIVATIONS
    if getattr(cfg, name) not in valid:
        raise ConfigError(name, f"must be one of {', '.join(map(repr, valid))}, got {getattr(cfg, name)!r}")


def _common_llm_trainer_raw(data: dict[str, Any], family: str) -> dict[str, Any]:
    """LLM-Trainer ModelConfig keys with one answer in both families: ``pre_norm`` (both families
    normalize before each sub-layer: true is accepted, false refused), ``vocab_size`` (refused: the
    vocabulary is the tokenizer's) and the activation spelling ``swish`` (= ``silu``)."""
    if "pre_norm" in data:
        pre_norm = data.pop("pre_norm")
        if pre_norm is not True:
            raise ConfigError("pre_norm", f"{pre_norm!r}: only pre-norm blocks exist here ({family} normalizes before "
                              "attention and MLP); drop pre_norm or set it true")
    if "vocab_size" in data:
        raise ConfigError("vocab_size", "the model's vocabulary is the tokenizer's: set data.tokenizer.vocab_size "
                          "(a BPE trained here) or use a Hugging Face tokenizer (data.tokenizer: NAME)")
    for key in ("activation", "activation_function"):
        if data.get(key) == "swish":
            data[key] = "silu"
    return data


@dataclass(frozen=True)
class RopeScaling:
    """Scaled rotary embeddings (linear, llama3, yarn): transformers' rope_parameters keys and meanings.

    Levanter's ``model.rope`` with a scaled ``type`` becomes this section (its ``theta`` is
    ``rope_theta``)."""

    type: Literal["linear", "llama3", "yarn"] = field(help="linear: positions divided by factor; llama3: Llama 3.1's per-wavelength scaling; yarn: YaRN (Peng et al. 2023).")
    factor: float = field(1.0, help="The context extension factor.")
    original_max_position_embeddings: int = field(8192, help="llama3, yarn: the context length the model was trained for.")
    low_freq_factor: float = field(1.0, help="llama3: wavelengths above original / low_freq_factor are scaled.")
    high_freq_factor: float = field(4.0, help="llama3: wavelengths below original / high_freq_factor are kept.")
    beta_fast: float = field(32.0, help="yarn: rotations above which frequencies are kept (extrapolated).")
    beta_slow: float = field(1.0, help="yarn: rotations below which frequencies are interpolated.")
    mscale: float | None = field(None, help="yarn: with mscale_all_dim, the attention factor's numerator scale.")
    mscale_all_dim: float | None = field(None, help="yarn: with mscale, the attention factor's denominator scale.")
    attention_factor: float | None = field(None, help="yarn: the cos/sin scale; null = 0.1 ln(factor) + 1 (transformers' default).")

    def validate(self) -> None:
        require_positive(self, "factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
        if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ConfigError("high_freq_factor", f"must be > low_freq_factor > 0, got {self.high_freq_factor} and "
                              f"{self.low_freq_factor}")

    def hf_parameters(self) -> dict[str, Any]:
        """The keys of transformers' ``rope_parameters`` for this scaling (besides rope_theta)."""
        keys = {"linear": ("factor",),
                "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
                "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                         "mscale_all_dim", "attention_factor")}[self.type]
        return {"rope_type": self.type, **{k: getattr(self, k) for k in keys if getattr(self, k) is not None}}


#: Levanter's ``gradient_checkpointing`` policies by name -> ours (recompute each block in the
#: backward pass, or keep every activation). Host offloading and nested (sqrt) remat are memory
#: schemes: each recomputes per block here, with the same results.
CHECKPOINTING_NAMES = {"full": True, "recompute": True, "nested": True, "offload": True, "save_all": False,
                       "none": False}


def _levanter_model_raw(data: dict[str, Any]) -> dict[str, Any]:
    """Levanter's model keys with a meaning here: ``gradient_checkpointing`` by policy name
    (:data:`CHECKPOINTING_NAMES`); the compute plan's keys (``attn_backend``, ...: their log line)."""
    from lm_pipeline.levanter import mapped

    data = mapped(data, "model")
    for name in ("flash_attention_block_size", "cross_entropy_block_size"):
        size = data.get(name)
        if isinstance(size, int) and not isinstance(size, bool) and size < 1:
            raise ConfigError(name, f"must be a positive number of rows, got {size}")
    policy = data.get("gradient_checkpointing")
    if isinstance(policy, str):
        if policy not in CHECKPOINTING_NAMES:
            raise ConfigError("gradient_checkpointing", f"unknown policy {policy!r}; use true, false or one of "
                              f"{', '.join(CHECKPOINTING_NAMES)}")
        from lm_pipeline.levanter import note

        data["gradient_checkpointing"] = CHECKPOINTING_NAMES[policy]
        note("model.gradient_checkpointing", f"Levanter's gradient_checkpointing: {policy!r} is "
             f"gradient_checkpointing: {str(CHECKPOINTING_NAMES[policy]).lower()} here "
             f"({'each block recomputed in the backward pass' if CHECKPOINTING_NAMES[policy] else 'no recomputation'})")
    return data


def _levanter_rope_raw(data: dict[str, Any]) -> dict[str, Any]:
    """Levanter's ``rope: {type: T, theta: X, ...}`` is ``rope_theta: X`` and, for a scaled type
    (linear with a factor other than 1, llama3, yarn), ``rope_scaling: {type: T, ...}``; its keys
    mean what transformers' ``rope_parameters`` keys of the same name mean."""
    if "rope" not in data:
        return data
    rope = data.pop("rope")
    rope = {"type": "default"} if rope is None else rope
    if not isinstance(rope, dict):
        raise ConfigError("rope", f"expected a mapping (type, theta, ...), got {rope!r}")
    rope = dict(rope)
    if "theta" in rope:
        theta = rope.pop("theta")
        if "rope_theta" in data and data["rope_theta"] != theta:
            raise ConfigError("rope.theta", "given together with rope_theta; keep one")
        data["rope_theta"] = theta
    kind = rope.get("type", "default")
    if kind in ("default", "linear") and rope.get("factor", 1.0) == 1.0 and set(rope) <= {"type", "factor"}:
        return data  # the plain rope
    if "rope_scaling" in data:
        raise ConfigError("rope", "given together with rope_scaling; keep one")
    data["rope_scaling"] = {**rope, "type": "linear" if kind == "default" else kind}
    return data


def require_divisible(name: str, value: int, by_name: str, by: int) -> None:
    """Raise ``ConfigError(name, "must be divisible by <by_name> (<by>), got <value>; e.g. <lo> or <hi>")``."""
    if by > 0 and value % by:
        lo = value // by * by
        options = " or ".join(str(v) for v in (lo, lo + by) if v > 0)
        raise ConfigError(name, f"must be divisible by {by_name} ({by}), got {value}; e.g. {options}")


@LmConfig.register("gpt2")
@dataclass(frozen=True)
class Gpt2Config(LmConfig):
    """GPT-2: learned positions, LayerNorm, GELU MLP, tied embeddings."""

    type: Literal["gpt2"] = field("gpt2", help="Model family: 'gpt2'.")
    seq_len: int = field(1024, help="Maximum sequence length (rows of the learned position embeddings).", aliases=("max_seq_len",))
    hidden_dim: int = field(768, help="Width of the residual stream (HF n_embd).", aliases=("d_model",))
    num_layers: int = field(12, help="Number of transformer blocks (HF n_layer).", aliases=("n_layers",))
    num_heads: int = field(12, help="Attention heads; must divide hidden_dim (HF n_head).", aliases=("n_heads",))
    mlp_scale: int | float = field(4, help="MLP hidden width as a multiple of hidden_dim (HF n_inner / n_embd); fractional when mlp_scale * hidden_dim is a whole number (e.g. 1.5 for n_inner 96, n_embd 64).")
    initializer_range: float = field(0.02, help="Std of the normal weight init; residual projections use it / sqrt(2 * num_layers).")
    embed_pdrop: float = field(0.0, help="Dropout on the embeddings (training only).")
    resid_pdrop: float = field(0.0, help="Dropout on each residual branch's output (training only).")
    attn_pdrop: float = field(0.0, help="Dropout on attention probabilities (training only; uses the explicit softmax path).")
    layer_norm_epsilon: float = field(1e-5, help="LayerNorm epsilon.")
    activation_function: Literal["gelu", "gelu_new", "relu", "silu"] = field("gelu_new", help="MLP activation: 'gelu' (exact), 'gelu_new' (tanh approximation), 'relu' or 'silu'.", aliases=("activation",))
    scale_attn_by_inverse_layer_idx: bool = field(False, help="Divide attention scores of layer i (0-based) by i + 1.")
    upcast_attn: bool = field(False, help="Compute attention in float32 (HF reorder_and_upcast_attn).")
    gradient_checkpointing: bool = field(True, help="Recompute each block's activations in the backward pass (saves memory, same results). Levanter's policy names: nested, offload, recompute, full = true; save_all = false.", semantic=False)
    # how, not what (Levanter's keys, mapped onto the compute plan: lm_pipeline.levanter)
    attn_backend: Literal["default", "nvte", "splash", "jax_flash", "vanilla"] | None = field(None, help=_HOW["attn_backend"], semantic=False)
    flash_attention_block_size: int | None = field(None, help=_HOW["flash_attention_block_size"], semantic=False)
    cross_entropy_block_size: int | None = field(None, help=_HOW["cross_entropy_block_size"], semantic=False)
    scan_layers: bool | None = field(None, help=_HOW["scan_layers"], semantic=False)
    use_bias: bool = field(True, help="Biases in linear layers and LayerNorms.")

    @classmethod
    def normalize_raw(cls, data: dict[str, Any]) -> dict[str, Any]:
        """LLM-Trainer's ModelConfig keys that are not plain aliases (``docs/llm-trainer.md``):
        ``d_ff`` -> ``mlp_scale = d_ff / hidden_dim``; ``dropout`` -> ``resid_pdrop`` and
        ``embed_pdrop``; ``attention_dropout`` -> ``attn_pdrop``; ``pre_norm: true`` (GPT-2 is
        pre-norm) accepted, false refused; ``vocab_size`` refused (the tokenizer's)."""
        data = _levanter_model_raw(_common_llm_trainer_raw(data, "gpt2"))
        if "d_ff" in data:
            d_ff = data.pop("d_ff")
            if "mlp_scale" in data:
                raise ConfigError("d_ff", "given together with mlp_scale; keep one (mlp_scale = d_ff / hidden_dim)")
            width = next((data[k] for k in ("hidden_dim", "d_model") if k in data), cls.hidden_dim)
            if not isinstance(d_ff, int) or isinstance(d_ff, bool) or d_ff < 1:
                raise ConfigError("d_ff", f"expected a positive integer (the MLP width), got {d_ff!r}")
            if not isinstance(width, int) or isinstance(width, bool) or width < 1:
                raise ConfigError("hidden_dim", f"must be a positive integer, got {width!r}")
            data["mlp_scale"] = d_ff // width if d_ff % width == 0 else d_ff / width
        for key, targets in (("dropout", ("resid_pdrop", "embed_pdrop")), ("attention_dropout", ("attn_pdrop",))):
            if key in data:
                value = data.pop(key)
                for target in targets:
                    if target in data:
                        raise ConfigError(key, f"given together with {target}; keep one ({key} sets {' and '.join(targets)})")
                    data[target] = value
        return data

    @property
    def head_dim(self) -> int:
        return self.hidden_dim // self.num_heads

    @property
    def mlp_dim(self) -> int:
        return int(round(self.mlp_scale * self.hidden_dim))

    def validate(self) -> None:
        require_positive(self, "seq_len", "hidden_dim", "num_layers", "num_heads", "mlp_scale", "layer_norm_epsilon")
        if self.initializer_range < 0:
            raise ConfigError("initializer_range", f"must be >= 0, got {self.initializer_range!r}")
        require_probability(self, "embed_pdrop", "resid_pdrop", "attn_pdrop")
        require_divisible("hidden_dim", self.hidden_dim, "num_heads", self.num_heads)
        require_activation(self)
        if isinstance(self.mlp_scale, float) and abs(self.mlp_scale * self.hidden_dim - self.mlp_dim) > 1e-6:
            raise ConfigError("mlp_scale", f"mlp_scale * hidden_dim must be a whole number (the MLP width), got "
                              f"{self.mlp_scale} * {self.hidden_dim} = {self.mlp_scale * self.hidden_dim}")

    def build(self, vocab_size: int, *, key: jax.Array) -> Gpt2Model:
        from lm_pipeline.models.gpt2 import Gpt2Model  # JAX/Equinox: loaded only to build a model

        return Gpt2Model(self, vocab_size, key=key)

    def num_params(self, vocab_size: int) -> int:
        d, m, b = self.hidden_dim, self.mlp_dim, int(self.use_bias)
        per_layer = (
            2 * d * (1 + b)  # ln_1, ln_2
            + 4 * d * d + 4 * d * b  # q, k, v, o (+ biases)
            + 2 * d * m + (m + d) * b  # mlp
        )
        return vocab_size * d + self.seq_len * d + self.num_layers * per_layer + d * (1 + b)

    def flops_per_token(self, vocab_size: int) -> float:
        """Training FLOPs per token, PaLM (Chowdhery et al. 2022, app. B) / Chinchilla style:
        ``6 * N + 12 * L * T * D`` where N counts the matmul weights (attention and MLP
        projections plus the LM head; not embeddings lookups, norms or biases) and the second
        term is the attention scores and weighted sum over the full T x T map (causal masking
        is not discounted, as in PaLM's MFU)."""
        d, m, layers = self.hidden_dim, self.mlp_dim, self.num_layers
        matmul = layers * (4 * d * d + 2 * d * m) + vocab_size * d
        return float(6 * matmul + 12 * layers * self.seq_len * d)


@LmConfig.register("llama")
@dataclass(frozen=True)
class LlamaConfig(LmConfig):
    """Llama: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP."""

    type: Literal["llama"] = field("llama", help="Model family: 'llama'.")
    seq_len: int = field(2048, help="Training sequence length (HF max_position_embeddings).", aliases=("max_seq_len",))
    hidden_dim: int = field(4096, help="Width of the residual stream (HF hidden_size).", aliases=("d_model",))
    intermediate_dim: int = field(11008, help="Hidden width of the SwiGLU MLP (HF intermediate_size).", aliases=("d_ff",))
    num_layers: int = field(32, help="Number of transformer blocks.", aliases=("n_layers",))
    num_heads: int = field(32, help="Query heads.", aliases=("n_heads",))
    num_kv_heads: int = field(32, help="Key/value heads; fewer than num_heads gives grouped-query attention (1: multi-query). Must divide num_heads.")
    head_dim: int | None = field(None, help="Per-head width; null means hidden_dim // num_heads.")
    activation_function: Literal["gelu", "gelu_new", "relu", "silu"] = field("silu", help="Gate activation of the MLP ('silu' = SwiGLU).", aliases=("activation",))
    initializer_range: float = field(0.02, help="Std of the normal weight init.")
    layer_norm_epsilon: float = field(1e-6, help="RMSNorm epsilon (HF rms_norm_eps).")
    rope_theta: float = field(10000.0, help="Rotary embedding base.")
    tie_word_embeddings: bool = field(False, help="Use the token embeddings as the LM head.")
    use_bias: bool = field(False, help="Biases in the attention and MLP projections (HF attention_bias and mlp_bias).")
    upcast_attn: bool = field(False, help="Compute attention in float32.")
    gradient_checkpointing: bool = field(True, help="Recompute each block's activations in the backward pass (saves memory, same results). Levanter's policy names: nested, offload, recompute, full = true; save_all = false.", semantic=False)
    # how, not what (Levanter's keys, mapped onto the compute plan: lm_pipeline.levanter)
    attn_backend: Literal["default", "nvte", "splash", "jax_flash", "vanilla"] | None = field(None, help=_HOW["attn_backend"], semantic=False)
    flash_attention_block_size: int | None = field(None, help=_HOW["flash_attention_block_size"], semantic=False)
    cross_entropy_block_size: int | None = field(None, help=_HOW["cross_entropy_block_size"], semantic=False)
    scan_layers: bool | None = field(None, help=_HOW["scan_layers"], semantic=False)
    rope_scaling: RopeScaling | None = field(None, help="Scaled rotary embeddings (type: linear, llama3 or yarn, and their keys as transformers' rope_parameters), exported to config.json's rope_parameters; null = the plain rope. Levanter's `rope: {type, theta, ...}` is rope_theta plus this.", hashed_at_default=False)
    use_layer_norm_weight: bool = field(True, help="RMSNorms scale by a learned weight; false = no scale (Levanter's OLMo-style norms; the weight stays at ones, so exports load in transformers unchanged).", hashed_at_default=False)

    @classmethod
    def normalize_raw(cls, data: dict[str, Any]) -> dict[str, Any]:
        """LLM-Trainer's ModelConfig keys (``docs/llm-trainer.md``): ``d_ff`` is an alias of
        ``intermediate_dim``; ``dropout``/``attention_dropout`` must be 0 (Llama has no dropout
        here); ``pre_norm: true`` accepted (Llama is pre-norm), false refused."""
        data = _levanter_rope_raw(_levanter_model_raw(_common_llm_trainer_raw(data, "llama")))
        for key in ("dropout", "attention_dropout"):
            if key in data:
                value = data.pop(key)
                if value not in (0, 0.0):
                    raise ConfigError(key, f"{value!r}: the llama family has no dropout here; use {key}: 0, or "
                                      "type: gpt2 (resid/embed/attn dropout)")
        return data

    def rope_parameters(self) -> dict[str, Any]:
        """transformers' ``rope_parameters`` of this model (``rope_type``, ``rope_theta``, scaling keys)."""
        scaled = self.rope_scaling.hf_parameters() if self.rope_scaling is not None else {"rope_type": "default"}
        return {**scaled, "rope_theta": self.rope_theta}

    @property
    def head_size(self) -> int:
        """The effective head dimension (``head_dim`` or ``hidden_dim // num_heads``)."""
        return self.head_dim if self.head_dim is not None else self.hidden_dim // self.num_heads

    def validate(self) -> None:
        require_positive(self, "seq_len", "hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads", "layer_norm_epsilon", "rope_theta")
        if self.initializer_range < 0:
            raise ConfigError("initializer_range", f"must be >= 0, got {self.initializer_range!r}")
        if self.num_heads % self.num_kv_heads:
            divisors = [d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0]
            raise ConfigError(
                "num_kv_heads",
                f"must divide num_heads ({self.num_heads}), got {self.num_kv_heads}; valid: {', '.join(map(str, divisors))}",
            )
        if self.head_dim is None:
            require_divisible("hidden_dim", self.hidden_dim, "num_heads", self.num_heads)
        elif self.head_dim <= 0:
            raise ConfigError("head_dim", f"must be positive or null, got {self.head_dim}")
        if self.head_size % 2:
            where = "head_dim" if self.head_dim is not None else "hidden_dim"
            raise ConfigError(where, f"the head dimension ({self.head_size}) must be even for rotary embeddings")
        require_activation(self)

    def build(self, vocab_size: int, *, key: jax.Array) -> LlamaModel:
        from lm_pipeline.models.llama import LlamaModel  # JAX/Equinox: loaded only to build a model

        return LlamaModel(self, vocab_size, key=key)

    def _matmul_params_per_layer(self) -> int:
        d, h, n, kv, i = self.hidden_dim, self.head_size, self.num_heads, self.num_kv_heads, self.intermediate_dim
        return 2 * d * n * h + 2 * d * kv * h + 3 * d * i

    def num_params(self, vocab_size: int) -> int:
        d, h, n, kv, i = self.hidden_dim, self.head_size, self.num_heads, self.num_kv_heads, self.intermediate_dim
        per_layer = 2 * d + self._matmul_params_per_layer()
        if self.use_bias:
            per_layer += n * h + 2 * kv * h + d + 2 * i + d
        head = 0 if self.tie_word_embeddings else vocab_size * d
        return vocab_size * d + head + self.num_layers * per_layer + d

    def flops_per_token(self, vocab_size: int) -> float:
        """Training FLOPs per token, PaLM (Chowdhery et al. 2022, app. B) / Chinchilla style:
        ``6 * N + 12 * L * T * N_heads * head_dim`` where N counts the matmul weights (q, k, v,
        o, gate, up, down and the LM head, tied or not; not the embedding lookup, norms or
        biases) and the second term is attention over the full T x T map (causal masking not
        discounted)."""
        matmul = self.num_layers * self._matmul_params_per_layer() + vocab_size * self.hidden_dim
        attn = 12 * self.num_layers * self.seq_len * self.num_heads * self.head_size
        return float(6 * matmul + attn)
