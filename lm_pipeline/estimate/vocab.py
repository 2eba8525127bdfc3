"""The vocabulary size the estimator assumes: the real tokenizer's, never a guess.

``data.tokenizer`` trained here (``kind: bpe``) has its configured ``vocab_size``; a Hugging Face
tokenizer (``tokenizer: <name or dir>``) is read: a local directory's ``tokenizer.json``, else the
name's ``tokenizer.json`` from the local Hugging Face cache, else from the hub (unless
``HF_HUB_OFFLINE`` is set). When none of these can be read, :func:`tokenizer_vocab_size` says so
in one line (pass ``--vocab_size``) rather than assuming a size.
"""

from __future__ import annotations

import os

from lm_pipeline import fs
from lm_pipeline.schema import ConfigError

__all__ = ["tokenizer_vocab_size"]


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def tokenizer_vocab_size(tok) -> int:
    """Vocabulary size of the tokenizer ``tok`` (a ``TokenizerConfig``) as training would see it."""
    from lm_pipeline.data.tokenizer import tokenizer_info

    if tok.kind == "bpe" or not tok.name_or_path:
        return int(tok.vocab_size)
    name = tok.name_or_path
    if fs.scheme(name) or fs.is_local_dir(name):  # a directory (local or a URL), not a hub repo id
        return int(tokenizer_info(os.path.expanduser(name)).vocab_size)
    from huggingface_hub import hf_hub_download

    problem = ""
    for local_only in (True, False):
        if not local_only and _offline():
            problem = "HF_HUB_OFFLINE is set"
            break
        try:
            path = hf_hub_download(name, "tokenizer.json", revision=tok.revision, local_files_only=local_only)
        except Exception as e:  # not cached / offline / unknown repo
            problem = (str(e).strip().splitlines() or [type(e).__name__])[0]
            continue
        folder = os.path.dirname(path)
        try:
            for extra in ("tokenizer_config.json", "special_tokens_map.json"):
                hf_hub_download(name, extra, revision=tok.revision, local_files_only=local_only)
        except Exception:
            pass
        try:
            return int(tokenizer_info(folder).vocab_size)
        except Exception:
            from tokenizers import Tokenizer

            return int(Tokenizer.from_file(path).get_vocab_size(with_added_tokens=True))
    raise ConfigError("data.tokenizer", f"cannot read tokenizer {name!r} to know its vocabulary size: not a local "
                      f"directory, not in the local Hugging Face cache, and not downloadable ({problem}); pass "
                      "--vocab_size N")
