"""Configuration of the data path: sources, validation policy, tokenizer, cache and packing.

Training data comes from exactly one of: ``train_urls`` (files read through fsspec), ``hf_id`` (a
Hugging Face dataset: hub id, ``save_to_disk`` directory, or a builder such as ``json`` with
``hf_data_files``) or ``builtin`` (a corpus that needs no download). Validation data is the set
named ``validation`` (from ``validation_urls``, ``hf_validation_split`` or the built-in corpus's
held-out part) plus any named sets in ``validation: {name: [urls]}``.

Levanter spellings are accepted: ``id`` / ``name`` / ``stream`` for the Hugging Face fields, and
``tokenizer: gpt2`` (a string) for ``tokenizer: {kind: hf, name_or_path: gpt2}``.

A mixture (Levanter's ``LMMixtureDatasetConfig``) names its components under ``configs``, each
with the source fields of :class:`SourceConfig`, and mixes them by ``train_weights`` (a mapping,
or phases ``[[step, mapping], ...]``); see :mod:`lm_pipeline.data.mixture`. The section's own
training source fields stay empty then. Every problem of a section is reported at once
(:class:`ConfigProblems`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Literal

from lm_pipeline.schema import ConfigError, ConfigProblems, field, raise_problems

__all__ = ["ChatFormatConfig", "ConfigProblems", "DataConfig", "SourceConfig", "TokenizerConfig", "raise_problems"]

#: Name of the validation set fed by ``validation_urls`` / ``hf_validation_split`` / a builtin.
DEFAULT_VALIDATION_SET = "validation"

_SET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")

#: How a mixture ends (Levanter's names): never (a component that runs out starts again in a new
#: order), when its first component runs out, or when its last one does (the others restarting).
STOP_STRATEGIES = ("restart", "first_exhausted", "all_exhausted")

#: Largest ``mixture_block_size``: a block's order is held in memory (8 bytes a row).
MAX_MIXTURE_BLOCK_SIZE = 1 << 20


@dataclass(frozen=True)
class TokenizerConfig:
    """Train a byte-level BPE on the training shards, or load a Hugging Face tokenizer."""

    kind: Literal["bpe", "hf"] = field("bpe", help="'bpe' trains a byte-level BPE on the training shards; 'hf' loads `name_or_path`.")
    vocab_size: int = field(4096, help="BPE vocabulary size, special tokens included.")
    min_frequency: int = field(2, help="BPE: minimum pair frequency for a merge.")
    special_tokens: tuple[str, ...] = field(("<|endoftext|>",), help="BPE: special tokens; the first is EOS (and BOS/PAD).")
    max_train_chars: int | None = field(None, help="BPE: train on at most this many characters, taken from the start of the training stream (null = all).")
    name_or_path: str | None = field(None, help="'hf': a hub name or a local directory holding tokenizer.json.")
    revision: str | None = field(None, help="'hf': hub revision (branch, tag or commit) of `name_or_path`.")
    eos_token: str | None = field(None, help="'hf': the EOS token to use, overriding (or supplying) the tokenizer's own.")

    def validate(self) -> None:
        if self.kind == "hf" and not self.name_or_path:
            raise ConfigError("name_or_path", "is required when kind is 'hf' (a hub name or a local directory)")
        if self.kind == "bpe" and not self.special_tokens:
            raise ConfigError("special_tokens", "needs at least one token (the first is EOS)")
        if len(set(self.special_tokens)) != len(self.special_tokens):
            raise ConfigError("special_tokens", "has duplicates")
        if self.kind == "bpe" and self.vocab_size < 256 + len(self.special_tokens):
            raise ConfigError("vocab_size", f"must be at least {256 + len(self.special_tokens)} for a byte-level BPE")
        if self.min_frequency < 1:
            raise ConfigError("min_frequency", "must be >= 1")
        if self.max_train_chars is not None and self.max_train_chars < 1:
            raise ConfigError("max_train_chars", "must be >= 1 (or null for no limit)")


#: Keys of Levanter's chat format (``format: {type: chat, ...}``).
CHAT_FORMAT_KEYS = ("messages_field", "chat_template", "single_turn", "pack", "mask_user_turns")


@dataclass(frozen=True)
class ChatFormatConfig:
    """A chat-formatted source (Levanter's ``format: {type: chat}``); see own-data.md#chat-formatted-sources.

    Each record holds a conversation, rendered through a chat template; the loss is taken on the
    assistant's tokens."""

    messages_field: str = field("messages", help="Key of the record's list of messages ({role, content}).")
    chat_template: str | None = field(None, help="The Jinja chat template (transformers' format); the assistant's text marked with {% generation %}...{% endgeneration %} for mask_user_turns. null = the tokenizer's own (tokenizer_config.json's chat_template, or chat_template.jinja in its directory); a BPE trained here has none.")
    single_turn: bool = field(False, help="Train on the first user message and the first assistant reply only, as prompt + reply text without a template (Levanter's single-turn chat); the loss on the reply.")
    pack: bool = field(True, help="Pack whole conversations into rows (greedy, segment ids keep them apart); false: one conversation per row, padded. A conversation longer than seq_len is split into seq_len pieces either way.")
    mask_user_turns: bool = field(True, help="Take the loss on the assistant's tokens only (true), or on every token of the conversation (false).")

    def validate(self) -> None:
        if not self.messages_field:
            raise ConfigError("messages_field", "must not be empty (the key of the record's list of messages)")
        if self.chat_template is not None and not self.chat_template.strip():
            raise ConfigError("chat_template", "is empty: give a Jinja chat template, or null for the tokenizer's own")
        if self.single_turn and self.chat_template is not None:
            raise ConfigError("chat_template", "single_turn renders no template (prompt + reply as text): remove "
                              "chat_template or set single_turn: false")
        if (self.chat_template is not None and self.mask_user_turns and not self.single_turn
                and not re.search(r"\{%-?\s*generation\s*-?%\}", self.chat_template)):
            raise ConfigError("chat_template", "has no {% generation %} block, so the assistant's tokens cannot be "
                              "told apart: wrap the assistant's content in {% generation %}...{% endgeneration %}, "
                              "or set mask_user_turns: false to train on every token")


@dataclass(frozen=True)
class SourceConfig:
    """One source of text (the data section's own, or a mixture component's): files, a Hugging
    Face dataset or a built-in corpus, and how its records are read and validated."""

    # --- files read through fsspec ---------------------------------------------------------
    train_urls: tuple[str, ...] = field((), help="Training shards: paths or fsspec URLs; brace expansion `{1..32}`, globs and directories allowed.")
    validation_urls: tuple[str, ...] = field((), help="Validation shards, evaluated as the set named 'validation'.")
    validation: dict[str, tuple[str, ...]] = field(default_factory=dict, help="Named validation sets: {name: [urls]}, each evaluated and reported on its own.")
    format: Literal["auto", "jsonl", "json", "text", "parquet"] = field("auto", help="Shard format; 'auto' picks it from the file extension (.jsonl/.ndjson, .json, .txt/.md, .parquet; then .gz/.zst).")
    text_key: str = field("text", help="Key of the text field in JSON/JSONL/Parquet/Hugging Face records.", aliases=("text_column",))
    chat: ChatFormatConfig | None = field(None, help="A chat-formatted source (Levanter's `format: {type: chat, ...}` is this): records hold conversations under chat.messages_field, rendered with the chat template into tokens and a loss mask (the loss on the assistant's turns). null = text records. See own-data.md#chat-formatted-sources.", hashed_at_default=False)
    json_records_key: str | None = field(None, help="JSON files holding an object: the key of its list of records (null = the object's only list, or the object itself as one record).")
    text_unit: Literal["file", "paragraph", "line"] = field("file", help="Plain-text files: one document per file, per blank-line-separated paragraph, or per non-blank line.")
    # --- Hugging Face datasets -------------------------------------------------------------
    hf_id: str | None = field(None, help="Hugging Face dataset: a hub id, a local `save_to_disk` directory, or a builder name ('json', 'parquet', 'csv', 'text') with hf_data_files.", aliases=("id", "dataset_name"))
    hf_name: str | None = field(None, help="Hugging Face dataset configuration (subset) name.", aliases=("name", "dataset_config"))
    hf_split: str = field("train", help="Hugging Face split used for training.", aliases=("dataset_split",))
    hf_validation_split: str | None = field(None, help="Hugging Face split evaluated as the set named 'validation' (e.g. 'validation' or 'test').", aliases=("validation_split",))
    hf_revision: str | None = field(None, help="Hub revision (branch, tag or commit sha) of hf_id; a commit sha pins the data.")
    hf_data_files: tuple[str, ...] = field((), help="Data files for a builder hf_id ('json', 'parquet', ...).")
    hf_streaming: bool = field(False, help="Stream the Hugging Face dataset instead of downloading and preparing it (one shard per underlying file).", aliases=("stream",))
    hf_shard_rows: int = field(100_000, help="Non-streamed Hugging Face datasets: rows per shard.")
    # --- built-in corpus -------------------------------------------------------------------
    builtin: Literal["python_stdlib"] | None = field(None, help="A built-in corpus that needs no download ('python_stdlib': the source of the Python standard library); used instead of urls.")
    builtin_max_bytes: int = field(4_000_000, help="Built-in corpus: cap on its total size in bytes of source text.")
    builtin_validation_fraction: float = field(0.05, help="Built-in corpus: fraction of documents held out (by hashed path) as the 'validation' set.")
    # --- validation policy -----------------------------------------------------------------
    min_length: int = field(1, help="Records whose text has fewer characters than this (after stripping whitespace) are invalid.")
    on_invalid: Literal["fail", "skip"] = field("fail", help="Validation policy: stop at the first invalid record, or skip it and count it per reason.")
    cache_dir: str | None = field(None, help="Where token caches are written and read: <cache_dir>/<fingerprint>/ (a local folder or an fsspec URL) instead of <store.root>/token_cache/<fingerprint>/. The store keeps a pointer, so lineage and staleness work the same; several experiments may share one cache_dir. A mixture component's own cache_dir holds that component's caches.", semantic=False)

    @classmethod
    def normalize_raw(cls, data: dict[str, Any]) -> dict[str, Any]:
        """``train_urls:``/``validation_urls:`` left empty (null) mean none; Levanter's ``format:
        {type: text, text_key: k}`` is ``text_key: k``; its other formats are refused."""
        for key in ("train_urls", "validation_urls"):
            if key in data and data[key] is None:
                del data[key]
        if isinstance(data.get("format"), dict):
            _levanter_format(data)
        return data

    def urls(self) -> list[tuple[str, str]]:
        """(field, URL or path) of every shard location this source names."""
        return [(where, url) for where, urls in (("train_urls", self.train_urls), ("validation_urls", self.validation_urls),
                                                 *((f"validation.{n}", u) for n, u in self.validation.items()))
                for url in urls]

    def url_problems(self) -> list[tuple[str, str]]:
        """(field, problem) for each shard URL this machine cannot open (:func:`lm_pipeline.fs.url_problem`)."""
        from lm_pipeline.fs import url_problem

        return [(where, problem) for where, url in self.urls() if (problem := url_problem(url))]

    def train_sources(self) -> list[str]:
        """Names of the fields that provide training data (at most one may be set)."""
        return [n for n, on in (("train_urls", bool(self.train_urls)), ("hf_id", self.hf_id is not None), ("builtin", self.builtin is not None)) if on]

    def source_problems(self) -> list[ConfigError]:
        """Every problem of the source fields, each naming its field (relative to this section)."""
        out: list[ConfigError] = []
        if self.cache_dir is not None and not self.cache_dir.strip():
            out.append(ConfigError("cache_dir", "must not be empty (null = <store.root>/token_cache)"))
        if self.min_length < 0:
            out.append(ConfigError("min_length", "must be >= 0"))
        if not self.text_key:
            out.append(ConfigError("text_key", "must not be empty"))
        if self.chat is not None and self.format == "text":
            out.append(ConfigError("format", "is 'text' (plain text files), but a chat source reads records with a "
                                   "list of messages: use jsonl, json, parquet or a Hugging Face dataset"))
        if self.chat is not None and self.builtin is not None:
            out.append(ConfigError("builtin", "is a text corpus: a chat source reads records with a list of messages "
                                   "(train_urls or id)"))
        sources = self.train_sources()
        if len(sources) > 1:
            out.append(ConfigError(sources[1], f"only one training source may be set, but {' and '.join(sources)} are; remove all but one"))
        default_val = [n for n, on in (("validation_urls", bool(self.validation_urls)), ("hf_validation_split", self.hf_validation_split is not None), ("builtin", self.builtin is not None)) if on]
        if len(default_val) > 1:
            out.append(ConfigError(default_val[0], f"the '{DEFAULT_VALIDATION_SET}' set can come from only one of {', '.join(default_val)}; "
                                   "put the others under `validation: {name: [urls]}`"))
        for name, urls in self.validation.items():
            if not _SET_NAME.match(name):
                out.append(ConfigError(f"validation.{name}", "set names must start with a letter or digit and use only letters, digits, '_', '.', '-'"))
            elif name == "train":
                out.append(ConfigError("validation.train", "'train' is reserved for the training split; pick another name"))
            elif name == DEFAULT_VALIDATION_SET and default_val:
                out.append(ConfigError(f"validation.{name}", f"'{name}' is already given by {default_val[0]}; pick another name"))
            elif not urls:
                out.append(ConfigError(f"validation.{name}", "needs at least one url"))
        if self.hf_validation_split is not None and self.hf_id is None:
            out.append(ConfigError("hf_validation_split", "needs hf_id"))
        if self.hf_data_files and self.hf_id is None:
            out.append(ConfigError("hf_data_files", "needs hf_id (a builder such as 'json' or 'parquet')"))
        if self.hf_shard_rows < 1:
            out.append(ConfigError("hf_shard_rows", "must be >= 1"))
        if self.builtin_max_bytes < 10_000:
            out.append(ConfigError("builtin_max_bytes", "must be >= 10000"))
        if not 0.0 < self.builtin_validation_fraction <= 0.5:
            out.append(ConfigError("builtin_validation_fraction", "must be in (0, 0.5]"))
        return out


def _levanter_format(data: dict[str, Any]) -> None:
    """Levanter's dataset formats (``format: {type: ...}``): ``text`` (records with a text field)
    is the text records read here; ``chat`` is ``chat: {...}`` (:class:`ChatFormatConfig`, its
    keys checked here, each problem naming ``format.<key>``); ``supervised`` is refused in one line."""
    from lm_pipeline.schema import from_dict

    fmt = dict(data.pop("format"))
    kind = fmt.pop("type", "text")
    if kind == "text" and set(fmt) <= {"text_key"}:
        if "text_key" in fmt:
            data["text_key"] = fmt["text_key"]
        return
    if kind == "chat":
        unknown = [k for k in fmt if k not in CHAT_FORMAT_KEYS]
        if unknown:
            raise ConfigError(f"format.{unknown[0]}", f"is not a key of Levanter's chat format; its keys are "
                              f"{', '.join(CHAT_FORMAT_KEYS)}")
        given = data.get("chat")
        if given is not None and not isinstance(given, dict):
            raise ConfigError("chat", f"expected a mapping (the chat format's keys), got {given!r}")
        # chat: {...} (an override of one key, say) takes precedence over the format's keys
        data["chat"] = from_dict(ChatFormatConfig, {**fmt, **(given or {})}, "format")
        return
    what = {"supervised": "input/output pairs, the loss on the output"}.get(kind)
    if what is None:
        raise ConfigError("format", f"a mapping is Levanter's format: {{type: text, text_key: ...}} is accepted, got "
                          f"{ {'type': kind, **fmt} }; or give one of 'auto', 'jsonl', 'json', 'text', 'parquet'")
    raise ConfigError("format", f"Levanter's `format: {{type: {kind}}}` ({what}) is not supported here: only text "
                      "is trained on; give this source records with a text field (format: jsonl, text_key: ...) "
                      "rendered as the text to train on, or remove the source")


def _is_set(cfg: Any, f: dataclasses.Field) -> bool:
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return getattr(cfg, f.name) != default


def _levanter_data_raw(data: dict[str, Any]) -> dict[str, Any]:
    """Levanter's ``shuffle: true`` (one permutation of the whole dataset per epoch) is ``shuffle:
    epoch``; ``shuffle: N`` (era shuffling with eras of N rows) is ``shuffle: era, era_length: N``;
    ``shuffle: false`` (the data's own order) is refused. ``enforce_eos: true`` is what the token
    cache does (every document ends with EOS); false is refused."""
    from lm_pipeline.levanter import note

    shuffle = data.get("shuffle")
    if shuffle is True:
        data["shuffle"] = "epoch"
        note("data.shuffle", "Levanter's data.shuffle: true is data.shuffle: epoch here (a permutation of all rows, "
             "new every epoch)")
    elif shuffle is False:
        raise ConfigError("shuffle", "Levanter's `data.shuffle: false` (rows in the data's order) is not supported "
                          "here: use shuffle: epoch (true) or an era length (shuffle: 4096)")
    elif isinstance(shuffle, int):
        if shuffle < 1:
            raise ConfigError("shuffle", f"an era length must be >= 1, got {shuffle}")
        if data.get("era_length", shuffle) != shuffle:
            raise ConfigError("shuffle", f"{shuffle} (an era length) given together with era_length "
                              f"{data['era_length']}; keep one")
        data["shuffle"], data["era_length"] = "era", shuffle
        note("data.shuffle", f"Levanter's data.shuffle: {shuffle} is data.shuffle: era with era_length: {shuffle} "
             "here")
    if "enforce_eos" in data:
        if data.pop("enforce_eos") is not True:
            raise ConfigError("enforce_eos", "Levanter's `data.enforce_eos: false` (documents without an appended "
                              "EOS) is not supported here: every document ends with EOS in the token cache; "
                              "remove it")
    return data


#: Keys of the data section that all components of a mixture share (refused inside one).
_SHARED_KEYS = ("tokenizer", "packing", "packing_strategy", "pack_sequences", "shuffle", "era_length", "num_workers",
                "preprocessing_num_workers", "shard_group_size", "configs", "train_weights", "stop_strategy",
                "mixture_block_size")


@dataclass(frozen=True)
class DataConfig(SourceConfig):
    """Where text comes from and how it becomes packed token sequences."""

    # --- downstream ------------------------------------------------------------------------
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig, help="The tokenizer to train or load.")
    packing: Literal["concat", "greedy", "first_fit"] = field("concat", help="How documents become seq_len rows: concatenate-and-chunk, or whole documents packed greedily / first-fit with segment ids. LLM-Trainer's `pack_sequences: true` means greedy (with `packing_strategy` choosing greedy or first_fit).", aliases=("packing_strategy",))
    shuffle: Literal["epoch", "era"] = field("epoch", help="Training row order. 'epoch': a seeded permutation of all rows, new every epoch (needs the complete token cache). 'era': Levanter's era shuffling: the first epoch is shuffled within consecutive eras of era_length rows, so step k needs only the cache's first eras and training can start while the cache is still being built (`lm-pipeline train` then builds it in the background, packing: concat); later epochs are shuffled whole. Levanter's spellings: true = 'epoch'; an integer N = 'era' with era_length N.")
    era_length: int = field(4096, help="shuffle: era: rows per era (the first epoch's shuffling window; the last era holds the rows left over). Step k needs the first ceil((k + 1) * train_batch_size / era_length) eras.")
    num_workers: int = field(0, help="Tokenizer worker processes; 0 means all cores (local uncompressed input under 8 MB is tokenized in this process: a worker's start-up costs more than it saves there).", semantic=False, aliases=("preprocessing_num_workers",))
    shard_group_size: int = field(8, help="Shards per cache-building group (the unit of resumption and fan-out).", semantic=False)
    # --- a mixture of sources (Levanter's LMMixtureDatasetConfig) ----------------------------
    # Semantic, hashed only when set (hashed_at_default=False): a config without a mixture keeps
    # its addresses. Each component's token cache is addressed by that component's source alone
    # (lm_pipeline.steps.mixture); the weights, stop strategy and block size enter the run's.
    configs: dict[str, SourceConfig] = field(default_factory=dict, help="A mixture's components: name -> a source with this section's source fields (train_urls, validation_urls, validation, format, text_key, id/hf_id, name, ..., builtin, min_length, on_invalid, cache_dir). Each is tokenized into its own token cache (shared by every experiment that uses the same source and tokenizer); training draws from them by train_weights and each validation set is evaluated as <component>/<set>; the section's own training source stays empty. See own-data.md#data-mixtures.", hashed_at_default=False)
    train_weights: dict[str, float] | tuple[tuple[int | dict[str, float], ...], ...] = field(default_factory=dict, help="A mixture's weights: {component: weight} for the whole run, or phases [[step, {component: weight}], ...] starting at step 0, each from its step on. Weights are relative (normalized per phase); a component left out has weight 0.", hashed_at_default=False)
    stop_strategy: Literal["restart", "first_exhausted", "all_exhausted"] = field("restart", help="When a mixture ends: never ('restart': a component that runs out starts again in a new order), when its first component runs out, or when its last one does (the others restarting meanwhile).", hashed_at_default=False)
    mixture_block_size: int = field(2048, help="A mixture's block: every block of this many rows holds each component's share of rows exactly (rounded down, the rows left over to the largest share), in a seeded order.", hashed_at_default=False)

    @classmethod
    def normalize_raw(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Levanter shorthand: ``tokenizer: gpt2`` means a Hugging Face tokenizer by name/path;
        ``train_urls:``/``validation_urls:`` left empty (null) mean none; LLM-Trainer's
        ``pack_sequences: true`` means whole documents packed (``packing: greedy`` unless
        ``packing``/``packing_strategy`` says otherwise). A mixture component that sets a key all
        components share, and ``train_weights`` of neither accepted shape, are refused here (every
        such problem at once)."""
        data = _levanter_data_raw(super().normalize_raw(data))
        if "pack_sequences" in data:
            pack = data.pop("pack_sequences")
            if pack is True:
                if "packing" not in data and "packing_strategy" not in data:
                    data["packing"] = "greedy"
            elif pack is False:
                raise ConfigError("pack_sequences", "false (one padded document per row) is not supported: every "
                                  "row is full here; use packing: greedy or first_fit (whole documents, segment ids "
                                  "keep them apart) or concat (concatenate and chunk)")
            else:
                raise ConfigError("pack_sequences", f"expected true or false, got {pack!r}")
        tok = data.get("tokenizer")
        if isinstance(tok, str):
            data["tokenizer"] = {"kind": "hf", "name_or_path": tok}
        problems = []
        configs = data.get("configs")
        for name, comp in (configs.items() if isinstance(configs, dict) else ()):
            for key in comp if isinstance(comp, dict) else ():
                if key in _SHARED_KEYS:
                    problems.append(ConfigError(f"configs.{name}.{key}", "a mixture's components share it: set it once "
                                                f"for all of them (data.{key}), not in a component"))
        if data.get("train_weights") is not None:
            from lm_pipeline.data.mixture import weight_phases

            problems += [ConfigError(path, message) for path, message in weight_phases(data["train_weights"])[1]]
        raise_problems(problems)
        return data

    def url_problems(self) -> list[tuple[str, str]]:
        """(field, problem) for each shard URL this machine cannot open (:func:`lm_pipeline.fs.url_problem`),
        a mixture's components included."""
        out = super().url_problems()
        for name, comp in self.configs.items():
            out += [(f"configs.{name}.{where}", problem) for where, problem in comp.url_problems()]
        return out

    def validate(self) -> None:
        problems = self.source_problems()
        if self.num_workers < 0:
            problems.append(ConfigError("num_workers", "must be >= 0 (0 = all cores)"))
        if self.shard_group_size < 1:
            problems.append(ConfigError("shard_group_size", "must be >= 1"))
        if self.era_length < 1:
            problems.append(ConfigError("era_length", "must be >= 1"))
        raise_problems(problems + self.mixture_problems() + self.chat_problems())

    def chat_sources(self) -> dict[str, SourceConfig]:
        """The chat-formatted sources: {config path prefix ('' or 'configs.<name>.'): source}."""
        out: dict[str, SourceConfig] = {"": self} if self.chat is not None else {}
        out.update({f"configs.{name}.": comp for name, comp in self.configs.items() if comp.chat is not None})
        return out

    def chat_problems(self) -> list[ConfigError]:
        """A chat source that would render with no template: the BPE trained here has none."""
        out = []
        for where, src in self.chat_sources().items():
            if self.tokenizer.kind == "bpe" and src.chat.chat_template is None and not src.chat.single_turn:
                out.append(ConfigError(f"{where}chat.chat_template", "is needed: the BPE tokenizer trained here "
                                       "(tokenizer.kind: bpe) has no chat template; set format.chat_template (a Jinja "
                                       "template, {% generation %} around the assistant's content) or use a "
                                       "tokenizer whose tokenizer_config.json has a chat_template"))
        return out

    def mixture_problems(self) -> list[ConfigError]:
        """Every problem of the mixture fields (``configs``, ``train_weights``, ``stop_strategy``,
        ``mixture_block_size``) and of each component, each naming its field."""
        if not self.configs:
            out = []
            if self.train_weights:
                out.append(ConfigError("train_weights", "weighs the components of a mixture, but configs names none: "
                                       "a mixture is configs: {name: {train_urls: [...]}, ...} with train_weights: "
                                       "{name: weight, ...}"))
            for name, default in (("stop_strategy", "restart"), ("mixture_block_size", 2048)):
                if getattr(self, name) != default:
                    out.append(ConfigError(name, "applies to a mixture only (configs: {name: {...}, ...}); remove it"))
            return out
        from lm_pipeline.data.mixture import schedule_problems, weight_phases

        out = [ConfigError(src, "a mixture takes its training data from its components: move it into one "
                           "(configs: {name: {train_urls: [...]}})") for src in self.train_sources()]
        for f in dataclasses.fields(SourceConfig):  # a source's own field set on the section: never read
            if f.name not in ("cache_dir", *self.train_sources()) and _is_set(self, f):
                out.append(ConfigError(f.name, f"belongs to one source, and a mixture's sources are its components: "
                                       f"set it in each component that needs it (configs.<name>.{f.name})"))
        phases, _ = weight_phases(self.train_weights)
        drawn = {name for _, weights in phases for name, w in weights.items() if w > 0}
        from lm_pipeline.data.component_names import name_problems

        out += [ConfigError(f"configs.{name}", problem) for name, problem in name_problems(self.configs)]
        for name, comp in self.configs.items():
            where = f"configs.{name}"
            out += [p.prefixed(where) for p in comp.source_problems()]
            has_validation = bool(comp.validation_urls or comp.validation or comp.hf_validation_split)
            if name in drawn and not comp.train_sources():
                out.append(ConfigError(where, "has a weight in train_weights but no training data: give train_urls, "
                                       "id (hf_id) or builtin"))
            elif not comp.train_sources() and not has_validation:
                out.append(ConfigError(where, "has no data: give train_urls, validation_urls, id (hf_id) or builtin"))
        if not 1 <= self.mixture_block_size <= MAX_MIXTURE_BLOCK_SIZE:
            out.append(ConfigError("mixture_block_size", f"must be between 1 and {MAX_MIXTURE_BLOCK_SIZE}, "
                                   f"got {self.mixture_block_size}"))
        if not self.train_weights:
            out.append(ConfigError("train_weights", "a mixture needs weights: {component: weight, ...}, or phases "
                                   "[[0, {component: weight, ...}], [step, {...}], ...]"))
        else:
            out += [ConfigError(path, message) for path, message in
                    schedule_problems(self.train_weights, list(self.configs), self.mixture_block_size)]
        return out
