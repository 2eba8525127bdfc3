"""Configuration of the data path: sources, validation policy, tokenizer, cache and packing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lm_pipeline.schema import ConfigError, field


@dataclass(frozen=True)
class TokenizerConfig:
    """Train a byte-level BPE on the training shards, or load a Hugging Face tokenizer."""

    kind: Literal["bpe", "hf"] = field("bpe", help="'bpe' trains a byte-level BPE on the training shards; 'hf' loads `name_or_path`.")
    vocab_size: int = field(4096, help="BPE vocabulary size, special tokens included.")
    min_frequency: int = field(2, help="BPE: minimum pair frequency for a merge.")
    special_tokens: tuple[str, ...] = field(("<|endoftext|>",), help="BPE: special tokens; the first is EOS (and BOS/PAD).")
    name_or_path: str | None = field(None, help="'hf': a hub name or a local directory holding tokenizer.json.")

    def validate(self) -> None:
        if self.kind == "hf" and not self.name_or_path:
            raise ConfigError("name_or_path", "is required when kind is 'hf' (a hub name or a local directory)")
        if self.kind == "bpe" and self.vocab_size < 256 + len(self.special_tokens):
            raise ConfigError("vocab_size", f"must be at least {256 + len(self.special_tokens)} for a byte-level BPE")
        if self.min_frequency < 1:
            raise ConfigError("min_frequency", "must be >= 1")


@dataclass(frozen=True)
class DataConfig:
    """Where text comes from and how it becomes packed token sequences."""

    train_urls: tuple[str, ...] = field((), help="Training shards: paths or fsspec URLs; brace expansion `{1..32}` and globs allowed.")
    validation_urls: tuple[str, ...] = field((), help="Validation shards, evaluated as the set named 'validation'.")
    validation: dict[str, tuple[str, ...]] = field(default_factory=dict, help="Named validation sets: {name: [urls]}, each evaluated and reported on its own.")
    builtin: str | None = field(None, help="A built-in corpus that needs no download ('python_stdlib'); used when no urls are given.")
    text_key: str = field("text", help="Key of the text field in JSON/JSONL/Parquet records.")
    format: Literal["auto", "jsonl", "json", "text", "parquet"] = field("auto", help="Shard format; 'auto' picks it from the file extension.")
    min_length: int = field(1, help="Records whose text has fewer characters than this are invalid.")
    on_invalid: Literal["fail", "skip"] = field("fail", help="Validation policy: stop at the first invalid record, or skip it and count it.")
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig, help="The tokenizer to train or load.")
    packing: Literal["concat", "greedy", "first_fit"] = field("concat", help="How documents become seq_len rows: concatenate-and-chunk, or whole documents packed greedily / first-fit with segment ids.")
    cache_dir: str | None = field(None, help="Where the token cache lives; default: under the store root.", semantic=False)
    num_workers: int = field(0, help="Tokenizer worker processes; 0 means all cores.", semantic=False)
    shard_group_size: int = field(8, help="Shards per cache-building group (the unit of resumption and fan-out).", semantic=False)

    def validate(self) -> None:
        if self.min_length < 0:
            raise ConfigError("min_length", "must be >= 0")
        if self.num_workers < 0:
            raise ConfigError("num_workers", "must be >= 0 (0 = all cores)")
        if self.shard_group_size < 1:
            raise ConfigError("shard_group_size", "must be >= 1")
