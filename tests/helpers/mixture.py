"""A tiny data mixture over the test corpus: three sources (web, code, books) and a tokenizer
that does not depend on them. Imported as ``from helpers.mixture import write_mixture``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from helpers import pipeline as pt
from lm_pipeline.data.config import TokenizerConfig

COMPONENTS = ("web", "code", "books")


def given_tokenizer(tmp: Path) -> Path:
    """A byte-level BPE trained once on other text: a tokenizer that does not depend on the data."""
    from lm_pipeline.data.tokenizer import build_tokenizer

    out = tmp / "tokenizer"
    texts = [p.read_text(encoding="utf-8") for p in sorted(Path(__file__).parent.glob("*.py"))]
    build_tokenizer(TokenizerConfig(kind="bpe", vocab_size=300), str(out), iter(texts), progress=False)
    return out


def mixture_config(tmp: Path, weights: Any, **data: Any) -> dict[str, Any]:
    """The tiny experiment with its corpus split into three sources: web (two shards and the
    validation set), code and books (one shard each)."""
    raw = pt.tiny_config(tmp)
    d = raw["data"]
    train_urls, val = d.pop("train_urls"), d.pop("validation_urls")
    tok = tmp / "tokenizer"
    if not tok.exists():
        given_tokenizer(tmp)
    d.update({"configs": {"web": {"train_urls": train_urls[:2], "validation_urls": val},
                          "code": {"train_urls": [train_urls[2]]}, "books": {"train_urls": [train_urls[3]]}},
              "train_weights": weights, "mixture_block_size": 8, "tokenizer": {"kind": "hf", "name_or_path": str(tok)},
              **data})
    return raw


def write_mixture(tmp: Path, weights: Any, name: str = "mix.yaml", **data: Any) -> Path:
    """:func:`mixture_config` written to ``tmp/name``."""
    path = tmp / name
    path.write_text(yaml.safe_dump(mixture_config(tmp, weights, **data), sort_keys=False), encoding="utf-8")
    return path


