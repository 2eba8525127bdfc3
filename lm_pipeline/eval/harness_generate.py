"""``generate_until`` of :class:`~lm_pipeline.eval.harness.HarnessLM`: contexts encoded and
left-truncated as the harness's HF backend does (to ``max_length - max_gen_toks`` tokens),
continued by the KV-cache generator (:func:`lm_pipeline.generate.generate`) in batches of
equal-length prompts with the same settings (one compiled program per prompt length), the text
decoded without special tokens and cut at the first stop sequence (EOS's text is always one).
Greedy unless a request asks ``do_sample: true``; sampling reads temperature, top_k and top_p.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from lm_pipeline.eval.harness import HarnessLM

__all__ = ["generate_requests"]


def _context_ids(lm: HarnessLM, context: str, max_ctx: int) -> list[int]:
    """The context's tokens as the HF backend's batch encoding makes them, left-truncated."""
    bos = lm.info.bos_token
    special = False if bos and context.startswith(bos) else (lm.add_bos_token if lm.add_bos_token is not None else True)
    ids = lm.tok_encode(context, add_special_tokens=special)
    return ids[-max_ctx:]


def _sampling(settings: dict[str, Any]) -> dict[str, Any]:
    if not settings.get("do_sample") or not settings.get("temperature"):
        return {"temperature": 0.0}
    return {"temperature": float(settings["temperature"]), "top_k": settings.get("top_k"),
            "top_p": settings.get("top_p")}


def generate_requests(lm: HarnessLM, requests: Sequence[tuple[str, dict[str, Any]]], *,
                      disable_tqdm: bool = False) -> list[str]:
    """The generated text of each ``(context, gen_kwargs)`` request, in order."""
    from lm_pipeline.generate import generate

    groups: dict[tuple[str, int], list[int]] = defaultdict(list)
    prepared = []
    for i, (context, gen_kwargs) in enumerate(requests):
        until, max_new, settings = lm.generation_settings(dict(gen_kwargs))
        max_ctx = lm.max_length - max_new
        if max_ctx < 1:
            raise ValueError(f"max_gen_toks ({max_new}) must be less than max_length ({lm.max_length})")
        ids = _context_ids(lm, context, max_ctx) or [lm.prefix_token_id]
        prepared.append((ids, until, max_new, _sampling(settings)))
        groups[(json.dumps([max_new, prepared[-1][3]], sort_keys=True), len(ids))].append(i)
    out: list[str] = [""] * len(requests)
    bar = tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm or None)
    for members in groups.values():
        for start in range(0, len(members), lm.batch_size):
            rows = members[start:start + lm.batch_size]
            _, _, max_new, sampling = prepared[rows[0]]
            prompt = np.asarray([prepared[i][0] for i in rows], np.int32)
            tokens = generate(lm.model, prompt, max_new, eos_id=lm.eot_token_id, vocab_size=lm.vocab,
                              plan=lm.plan, **sampling)
            for r, i in enumerate(rows):
                text = lm.tok_decode(tokens[r, prompt.shape[1]:].tolist())
                out[i] = lm.cut_at_stop(text, prepared[i][1])
                lm.cache_hook.add_partial("generate_until", requests[i], out[i])
            bar.update(len(rows))
    bar.close()
    return out
