"""Our JAX models behind lm-evaluation-harness's ``LM`` interface.

:class:`HarnessLM` answers the harness's three request types with a model of ours and the run's
tokenizer (``tokenizer.json`` through ``tokenizers``, no ``transformers``):

* ``loglikelihood(context, continuation)``: the sum of the continuation tokens' log-probabilities
  and whether each is the greedy choice, batched by length (:mod:`lm_pipeline.eval.harness_scoring`);
* ``loglikelihood_rolling(text)``: the whole text's log-likelihood over the harness's disjoint
  rolling windows of ``max_length`` tokens, the first conditioned on the prefix token;
* ``generate_until(context, gen_kwargs)``: greedy (or sampled) continuation with the KV-cache
  generator (:func:`lm_pipeline.generate.generate`), cut at the first stop sequence.

Token sequences are the ones the harness's Hugging Face backend (``HFLM``) builds from the same
``tokenizer.json``, so both score the same tokens: a context and continuation are encoded
together and split where the context's own encoding ends (spaces ending the context move to the
continuation); an empty context is the prefix token (BOS if the tokenizer has one, else EOS);
encodings get the tokenizer's special tokens (its post-processor; ``add_bos_token`` True/False
forces them on/off, and a text that already starts with BOS gets none); a window longer than
``max_length + 1`` tokens is cut from the left; log-probabilities are over the tokenizer's
vocabulary (the rows a padded model vocabulary adds are left out, as an export slices them off).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from lm_pipeline.compute import plan_for_params
from lm_pipeline.eval.harness_scoring import score_windows
from lm_pipeline.models.base import LmModel

__all__ = ["HarnessLM", "load_harness_lm"]

#: The harness's default number of new tokens for generate_until (as its HF backend's).
MAX_GEN_TOKS = 256


class HarnessLM(TemplateLM):
    """lm-evaluation-harness's ``LM`` over one of our models (see the module docstring).

    ``max_length``: the longest window the model reads (default: the model's ``seq_len``);
    ``batch_size``: rows per forward pass and per generation batch; ``prefix_token_id``: the
    token an empty context or a rolling window starts from (default BOS, else EOS).
    """

    def __init__(self, model: LmModel, tokenizer_dir: str | os.PathLike, *, max_length: int | None = None,
                 batch_size: int = 16, add_bos_token: bool | None = None, prefix_token_id: int | None = None,
                 max_gen_toks: int = MAX_GEN_TOKS, model_vocab: int | None = None) -> None:
        super().__init__()
        from lm_pipeline.data.tokenizer import load_tokenizer, tokenizer_info

        self.model = model
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.info = tokenizer_info(tokenizer_dir)
        rows = int(model_vocab or model.token_embeddings.shape[0])
        self.vocab = min(self.info.vocab_size, rows)
        seq_len = int(model.config.seq_len)
        self.max_length = min(max_length, seq_len) if max_length else seq_len
        self.batch_size = int(batch_size)
        self.add_bos_token = add_bos_token
        self._prefix_token_id = prefix_token_id
        self.max_gen_toks = int(max_gen_toks)
        self.plan = plan_for_params(model)

    # --- tokens ----------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.info.eos_id

    @property
    def prefix_token_id(self) -> int:
        if self._prefix_token_id is not None:
            return self._prefix_token_id
        return self.info.bos_id if self.info.bos_id is not None else self.info.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        """Token ids of ``string``; special tokens as the module docstring says."""
        if add_special_tokens is None:
            add_special_tokens = self.add_bos_token if self.add_bos_token is not None else True
            prefix_text = self.tokenizer.decode([self.prefix_token_id], skip_special_tokens=False)
            if prefix_text and string.startswith(prefix_text):
                add_special_tokens = False
        ids = self._encode(string, add_special_tokens)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def _encode(self, string: str, add_special_tokens: bool) -> list[int]:
        ids = self.tokenizer.encode(string, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.info.bos_id is not None and ids[:1] != [self.info.bos_id]:
            ids = [self.info.bos_id, *ids]  # add_bos_token forces BOS where the post-processor adds none
        return ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    @property
    def tokenizer_name(self) -> str:
        return os.fspath(self.info.path).replace("/", "__")

    # --- log-likelihoods -------------------------------------------------------------------

    def _score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], disable_tqdm: bool, desc: str):
        windows, n_scored = [], []
        for context, continuation in pairs:
            if not context or not continuation:
                raise ValueError("a log-likelihood request needs a non-empty context and continuation (in tokens)")
            if len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens exceeds max_length {self.max_length}")
            windows.append([*context, *continuation][-(self.max_length + 1):])
            n_scored.append(len(continuation))
        bar = tqdm(total=len(windows), desc=desc, disable=disable_tqdm or None)
        try:
            return score_windows(self.model, windows, n_scored, vocab=self.vocab, max_length=self.max_length,
                                 batch_size=self.batch_size, plan=self.plan, progress=bar.update)
        finally:
            bar.close()

    def _loglikelihood_tokens(self, requests: Sequence[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        scored = self._score([(ctx, cont) for _, ctx, cont in requests], disable_tqdm, "loglikelihood")
        out = [(s.logprob, s.greedy) for s in scored]
        for (key, _, _), answer in zip(requests, out, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    def loglikelihood_rolling(self, requests: Iterable[Any], disable_tqdm: bool = False) -> list[float]:
        texts = [req.args[0] for req in requests]
        pairs, owner = [], []
        for i, text in enumerate(texts):
            windows = get_rolling_token_windows(token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                                                max_seq_len=self.max_length, context_len=1)
            for context, continuation in map(make_disjoint_window, windows):
                pairs.append((context, continuation))
                owner.append(i)
        totals = np.zeros(len(texts), np.float64)
        for i, s in zip(owner, self._score(pairs, disable_tqdm, "loglikelihood_rolling"), strict=True):
            totals[i] += s.logprob
        for text, total in zip(texts, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), float(total))
        return [float(t) for t in totals]

    # --- generation ------------------------------------------------------------------------

    def generate_until(self, requests: Iterable[Any], disable_tqdm: bool = False) -> list[str]:
        from lm_pipeline.eval.harness_generate import generate_requests

        return generate_requests(self, [req.args for req in requests], disable_tqdm=disable_tqdm)

    def generation_settings(self, gen_kwargs: dict[str, Any]) -> tuple[list[str], int, dict[str, Any]]:
        """(stop sequences with EOS's text added, new tokens, sampling settings) of a request's
        ``gen_kwargs``, as the harness's HF backend reads them."""
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        return until, int(kwargs.pop("max_gen_toks")), kwargs

    @staticmethod
    def cut_at_stop(text: str, until: Sequence[str]) -> str:
        return postprocess_generated_text(generation=text, stop=list(until), think_end_token=None)


def load_harness_lm(checkpoint: str | os.PathLike, *, dtype: Any = None, **kwargs: Any) -> HarnessLM:
    """A :class:`HarnessLM` over a checkpoint (a ``step-<N>`` or run dir) or a Hugging Face
    model directory, loaded as evaluation loads it; the tokenizer is the one it holds."""
    from lm_pipeline.eval.loading import load_model_from_checkpoint

    loaded = load_model_from_checkpoint(checkpoint, dtype=dtype)
    if loaded.tokenizer_dir is None:
        raise FileNotFoundError(f"{os.fspath(checkpoint)} holds no tokenizer (tokenizer/ or tokenizer.json): "
                                "the harness's tasks are text")
    return HarnessLM(loaded.model, loaded.tokenizer_dir, model_vocab=loaded.vocab_size, **kwargs)
