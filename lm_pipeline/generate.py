"""Text generation with the KV cache: one jitted program per (model, prompt shape, settings).

:func:`generate` runs the prompt through the model once (the *prefill*, filling the key/value
cache), then a ``lax.while_loop`` of single-token decode steps with static shapes: the cache is
allocated for ``prompt + max_new_tokens`` positions up front and each step writes one position.
The whole loop is one XLA program, so there is no per-token Python or dispatch overhead. The
loop ends early once every row has produced ``eos_id``.

Layer unrolling (``unroll_layers``, default on for models with stacked ``blocks``). The models
keep their blocks stacked (``[layers, ...]`` arrays) and ``decode`` scans over them; inside the
token loop a scan slices every layer's weights out of the stacked arrays at every step. Here the
model's blocks are split into per-layer arrays once, before the token loop
(:func:`lm_pipeline.models.layers.unstack_layers`), and the same ``model.decode`` applies them
one by one with one key/value buffer per layer: same numbers, one decoder.

Token selection: greedy (argmax) when ``temperature == 0``; otherwise sampling from
``softmax(logits / temperature)`` restricted to the ``top_k`` most likely tokens and to the
smallest set whose probability reaches ``top_p`` (nucleus), in that order, as ``transformers``
applies them. Sampling is reproducible: step i uses ``fold_in(PRNGKey(seed), i)``. The
temperature, ``top_p`` and the seed are traced values: changing them reuses the compiled program
(greedy vs sampling, ``top_k`` and whether ``top_p`` is used are part of the program).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from lm_pipeline.compute import ComputePlan, plan_for_params
from lm_pipeline.models.base import LmModel
from lm_pipeline.models.layers import unstack_layers
from lm_pipeline.xla_cache import enable as enable_xla_cache

logger = logging.getLogger(__name__)

__all__ = ["SamplingError", "check_sampling", "generate", "generate_text", "select_tokens"]


def select_tokens(
    logits: jax.Array,
    key: jax.Array | None,
    *,
    temperature: float | jax.Array = 0.0,
    top_k: int | None = None,
    top_p: float | jax.Array | None = None,
    vocab_size: int | None = None,
) -> jax.Array:
    """logits [B, V] -> int32 [B]: greedy, or sampled with temperature / top-k / top-p.

    Greedy when ``temperature`` is the Python number 0 (an array temperature always samples).
    ``top_p``: None or a Python number >= 1 disables it; an array is always applied.
    ``vocab_size``: only ids below it can be chosen (a model vocabulary padded beyond the
    tokenizer's never emits the padding ids).
    """
    logits = logits.astype(jnp.float32)
    v = logits.shape[-1]
    neg = jnp.float32(-jnp.inf)
    if vocab_size is not None and vocab_size < v:
        logits = jnp.where(jnp.arange(v) < vocab_size, logits, neg)
    if isinstance(temperature, (int, float)) and temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / jnp.asarray(temperature, jnp.float32)
    if top_k is not None and 0 < top_k < v:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, neg, logits)
    if top_p is not None and not (isinstance(top_p, (int, float)) and top_p >= 1.0):
        desc = -jnp.sort(-logits, axis=-1)
        probs = jax.nn.softmax(desc, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
        kept = jnp.maximum(jnp.sum(before < top_p, axis=-1, keepdims=True), 1)
        threshold = jnp.take_along_axis(desc, kept - 1, axis=-1)
        logits = jnp.where(logits < threshold, neg, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@eqx.filter_jit
def _generate(
    model: LmModel,
    prompt: jax.Array,
    key: jax.Array,
    temperature: jax.Array | None,
    top_p: jax.Array | None,
    max_new: int,
    top_k: int | None,
    eos_id: int | None,
    pad_id: int,
    vocab_size: int | None,
    cache_dtype: Any,
    unroll_layers: bool,
    plan: ComputePlan,
) -> jax.Array:
    b, p = prompt.shape

    def select(logits, i):
        return select_tokens(logits, jax.random.fold_in(key, i), temperature=0.0 if temperature is None else temperature,
                             top_k=top_k, top_p=top_p, vocab_size=vocab_size)

    # Positions used: 0 .. p + max_new - 2 (the last token is chosen, never fed back).
    max_len = p + max_new - 1
    if unroll_layers:
        model = unstack_layers(model)
    cache = model.init_cache(b, max_len, cache_dtype)

    def decode(tokens, cache, position):
        return model.decode(tokens, cache, position, plan=plan)
    logits, cache = decode(prompt, cache, jnp.int32(0))
    tok = select(logits[:, -1], 0)
    out = jnp.full((b, max_new), pad_id, jnp.int32)
    done = jnp.zeros((b,), bool)

    def emit(out, done, tok, i):
        tok = jnp.where(done, pad_id, tok)
        out = jax.lax.dynamic_update_slice(out, tok[:, None], (jnp.int32(0), i))
        if eos_id is not None:
            done = done | (tok == eos_id)
        return out, done, tok

    def cond(carry):
        i, _, _, _, done = carry
        return (i < max_new - 1) & ~jnp.all(done)

    def body(carry):
        i, tok, cache, out, done = carry
        out, done, tok = emit(out, done, tok, i)
        logits, cache = decode(tok[:, None], cache, p + i)
        return i + 1, select(logits[:, 0], i + 1), cache, out, done

    i, tok, cache, out, done = jax.lax.while_loop(cond, body, (jnp.int32(0), tok, cache, out, done))
    out, _, _ = emit(out, done, tok, i)
    return jnp.concatenate([prompt.astype(jnp.int32), out], axis=1)


def generate(
    model: LmModel,
    prompt_ids: Any,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_id: int | None = None,
    pad_id: int | None = None,
    vocab_size: int | None = None,
    dtype: Any = None,
    unroll_layers: bool | None = None,
    plan: ComputePlan | None = None,
) -> np.ndarray:
    """Continue ``prompt_ids`` by ``max_new_tokens`` tokens; returns prompt + continuation.

    Args:
        model: any :class:`LmModel` with ``init_cache`` / ``decode``.
        prompt_ids: int [P] or [B, P] (rows of equal length, at least one token).
        temperature: 0 = greedy; otherwise sample (with ``top_k`` / ``top_p`` if given) using
            ``seed``.
        eos_id: a row that emits it is finished: its later positions hold ``pad_id`` (default
            ``eos_id``); the loop stops once all rows are finished.
        vocab_size: never choose ids >= vocab_size (padded model vocabularies).
        dtype: cast the parameters (and the cache) first, e.g. ``"bfloat16"``.
        unroll_layers: per-layer weights and caches (see the module docstring); None = for
            models with stacked ``blocks``; False = the stacked model as it is.
        plan: how the model computes; default: the plan for one device of the default backend
            in the parameters' dtype (:func:`lm_pipeline.compute.plan_for_devices`).

    Returns int32 numpy [B, P + max_new_tokens] (or [P + max_new_tokens] for a 1-D prompt).
    The prompt plus continuation must fit the model's positions (GPT-2: ``seq_len``).
    """
    ids = np.asarray(prompt_ids)
    squeeze = ids.ndim == 1
    if squeeze:
        ids = ids[None]
    _check_generate_args(model, ids, max_new_tokens, temperature, top_k, top_p)
    cache_dtype = None
    if dtype is not None:
        from lm_pipeline.eval import resolve_dtype
        from lm_pipeline.train.trainer import cast_floating

        cache_dtype = resolve_dtype(dtype)
        model = cast_floating(model, cache_dtype)
    if pad_id is None:
        pad_id = eos_id if eos_id is not None else 0
    known = hasattr(model, "blocks")
    if unroll_layers and not known:
        raise ValueError(f"unroll_layers needs a model with stacked blocks, not {type(model).__name__}")
    unroll = known if unroll_layers is None else unroll_layers
    greedy = temperature == 0
    if plan is None:
        plan = plan_for_params(model)
    out = _generate(
        model, jnp.asarray(ids, jnp.int32), jax.random.PRNGKey(seed),
        None if greedy else jnp.float32(temperature),
        None if greedy or top_p is None or top_p >= 1.0 else jnp.float32(top_p),
        int(max_new_tokens), None if greedy or top_k is None else int(top_k),
        None if eos_id is None else int(eos_id), int(pad_id), None if vocab_size is None else int(vocab_size),
        cache_dtype, bool(unroll), plan,
    )
    out = np.asarray(out)
    return out[0] if squeeze else out


def _check_generate_args(model: LmModel, ids: np.ndarray, max_new_tokens: int, temperature: float,
                         top_k: int | None, top_p: float | None) -> None:
    """Raise ValueError naming the first argument of :func:`generate` that is out of range."""
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError(f"prompt_ids must be [P] or [B, P] with P >= 1, got shape {ids.shape}")
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    seq_len = getattr(getattr(model, "config", None), "seq_len", None)
    if getattr(getattr(model, "config", None), "type", None) == "gpt2" and ids.shape[1] + max_new_tokens > seq_len:
        raise ValueError(
            f"prompt ({ids.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds the model's seq_len ({seq_len})"
        )
    if seq_len is not None and ids.shape[1] + max_new_tokens > seq_len:  # rotary positions: it runs, untrained
        logger.warning("generating to position %d, past the %d positions the model was trained on: the text "
                       "beyond them is extrapolation (lower max_new_tokens or shorten the prompt)",
                       ids.shape[1] + max_new_tokens, seq_len)


class SamplingError(ValueError):
    """A generation argument out of range; the message names the argument and what is allowed."""


def check_sampling(max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                   top_p: float | None = None) -> None:
    """Refuse sampling settings that cannot mean anything, before any model is loaded."""
    problems = []
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        problems.append(f"max_new_tokens must be >= 1 (the number of tokens to generate), got {max_new_tokens}")
    if not np.isfinite(temperature) or temperature < 0:
        problems.append(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        problems.append(f"top_k must be >= 1 (or unset: no top-k cut), got {top_k}")
    if top_p is not None and not (0 < top_p <= 1):
        problems.append(f"top_p must be in (0, 1] (or unset: no nucleus cut), got {top_p}")
    if problems:
        raise SamplingError("; ".join(problems))


def generate_text(
    step_dir: str | os.PathLike,
    prompt: str | Sequence[str],
    max_new_tokens: int = 64,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    stop_at_eos: bool = True,
    dtype: Any = None,
) -> str | list[str]:
    """The continuation of ``prompt`` (text) by the checkpoint's model, decoded with its tokenizer.

    ``step_dir``: a checkpoint dir (or run dir: its latest checkpoint) holding ``tokenizer/``.
    The prompt is encoded as in the token cache (BOS first if the tokenizer adds one; an empty
    prompt starts from EOS, the document separator). Generation stops at EOS
    (``stop_at_eos``); special tokens are dropped from the text. A list of prompts gives a list.
    """
    from lm_pipeline.data.tokenizer import load_tokenizer, tokenizer_info
    from lm_pipeline.eval import load_model_from_checkpoint

    check_sampling(max_new_tokens, temperature, top_k, top_p)
    loaded = load_model_from_checkpoint(step_dir, dtype=dtype)
    enable_xla_cache(loaded.config.store.root)
    if loaded.tokenizer_dir is None:
        raise FileNotFoundError(f"{os.fspath(step_dir)}: the checkpoint has no tokenizer/ dir")
    tok = load_tokenizer(loaded.tokenizer_dir)
    info = tokenizer_info(loaded.tokenizer_dir)
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    texts = []
    for text in prompts:
        ids = tok.encode(text, add_special_tokens=False).ids
        if info.adds_bos and info.bos_id is not None:
            ids = [info.bos_id, *ids]
        if not ids:
            ids = [info.eos_id]
        out = generate(
            loaded.model, np.asarray(ids, np.int32), max_new_tokens, temperature=temperature, top_k=top_k,
            top_p=top_p, seed=seed, eos_id=info.eos_id if stop_at_eos else None,
            vocab_size=min(info.vocab_size, loaded.vocab_size),
        )
        new = out[len(ids):].tolist()
        if stop_at_eos and info.eos_id in new:
            new = new[: new.index(info.eos_id)]
        texts.append(tok.decode(new, skip_special_tokens=True))
    return texts[0] if isinstance(prompt, str) else texts
