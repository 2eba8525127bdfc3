"""Tokenizers: train a deterministic byte-level BPE, or bring any Hugging Face tokenizer.

Either way the output directory holds ``tokenizer.json`` (what :mod:`tokenizers` loads),
``tokenizer_config.json`` and ``special_tokens_map.json``, such that
``transformers.AutoTokenizer.from_pretrained(out_dir)`` loads a fast tokenizer
(``PreTrainedTokenizerFast``) that encodes exactly like ``tokenizers.Tokenizer.from_file``,
with ``eos_token`` set (and ``bos_token`` / ``pad_token`` where the source has them; a trained BPE
uses its first special token for all three, as GPT-2 does).

Determinism: :func:`train_bpe` over the same texts in the same order writes a byte-identical
``tokenizer.json`` (the BPE trainer breaks count ties by the pair itself, and the file is written
from one canonical serialisation). ``check_determinism=True`` trains twice and raises if the two
results differ.

Whether a tokenizer adds BOS (or EOS) itself is never assumed: :func:`tokenizer_info` encodes a
probe text with and without special tokens and compares.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from lm_pipeline import fs
from lm_pipeline.data.config import TokenizerConfig
from lm_pipeline.faultpoints import faultpoint

__all__ = [
    "TokenizerInfo",
    "build_tokenizer",
    "load_hf_tokenizer",
    "load_tokenizer",
    "tokenizer_info",
    "train_bpe",
]

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_MAP_FILE = "special_tokens_map.json"
_PROBE = "Hello world: a probe, 123."
_MAX_LEN = int(1e30)  # transformers' "no limit" (VERY_LARGE_INTEGER)
_ROLES = ("bos_token", "eos_token", "unk_token", "pad_token")


class TokenizerError(ValueError):
    """A tokenizer that cannot be used as configured (no EOS, not a fast tokenizer, ...)."""


@dataclass(frozen=True)
class TokenizerInfo:
    """What the rest of the pipeline needs to know about a tokenizer directory."""

    path: str
    vocab_size: int
    eos_token: str
    eos_id: int
    bos_token: str | None
    bos_id: int | None
    pad_id: int | None
    adds_bos: bool  # encode(..., add_special_tokens=True) starts with BOS
    adds_eos: bool  # encode(..., add_special_tokens=True) ends with EOS
    fingerprint: str  # sha256 of tokenizer.json and the special-token roles


# --- files ----------------------------------------------------------------------------------


def _atomic_write(path: str, data: bytes) -> None:
    from lm_pipeline.atomic import atomic_write_bytes

    atomic_write_bytes(path, data)  # local: temp + rename; object stores: one PUT


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def _token_str(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):  # AddedToken serialisation
        return value.get("content")
    return str(value)


def _write_dir(
    out_dir: str | os.PathLike,
    tokenizer_json: bytes,
    roles: dict[str, str | None],
    extra: dict[str, Any] | None = None,
    additional: list[str] | None = None,
    source: str | None = None,
) -> TokenizerInfo:
    """Write the three files (configs first, tokenizer.json last) and return the info;
    ``source`` names where ``tokenizer_json`` was read from (in an error)."""
    out = os.fspath(out_dir)
    tok = _parse_tokenizer(tokenizer_json, source or TOKENIZER_FILE)
    fs.makedirs(out)
    for role, token in roles.items():
        if token is not None and tok.token_to_id(token) is None:
            raise TokenizerError(f"{role} {token!r} is not in the tokenizer's vocabulary")
    special = {k: v for k, v in roles.items() if v is not None}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": _MAX_LEN,
        "clean_up_tokenization_spaces": False,
        **(extra or {}),
        **special,
    }
    smap: dict[str, Any] = dict(special)
    if additional:
        smap["additional_special_tokens"] = list(additional)
    _atomic_write(fs.join(out, CONFIG_FILE), _json_bytes(config))
    faultpoint("tokenizer.after_config")  # the first file is written
    _atomic_write(fs.join(out, SPECIAL_MAP_FILE), _json_bytes(smap))
    faultpoint("tokenizer.after_special_map")
    _atomic_write(fs.join(out, TOKENIZER_FILE), tokenizer_json)
    return tokenizer_info(out)


# --- training -------------------------------------------------------------------------------


def _capped(texts: Iterable[str], max_chars: int | None) -> Iterator[str]:
    if max_chars is None:
        yield from texts
        return
    left = max_chars
    for t in texts:
        if left <= 0:
            return
        if len(t) > left:
            t = t[:left]
        left -= len(t)
        yield t


#: BPE training is quadratic in the length of a pre-token (a 1 MB word takes a quarter of an hour):
#: runs of non-space characters longer than this are cut into pieces of this size for training
#: (only training: encoding with the trained tokenizer sees the text unchanged).
MAX_TRAIN_WORD = 1000
_LONG_RUN = re.compile(rf"\S{{{MAX_TRAIN_WORD + 1},}}")


def _split_long_words(texts: Iterable[str]) -> Iterator[str]:
    """The texts, each long run of non-space characters cut into ``MAX_TRAIN_WORD`` pieces
    (yielded as separate texts, so no training word is longer)."""
    for text in texts:
        if len(text) <= MAX_TRAIN_WORD or _LONG_RUN.search(text) is None:
            yield text
            continue
        pos = 0
        for m in _LONG_RUN.finditer(text):
            if m.start() > pos:
                yield text[pos : m.start()]
            for i in range(m.start(), m.end(), MAX_TRAIN_WORD):
                yield text[i : min(i + MAX_TRAIN_WORD, m.end())]
            pos = m.end()
        if pos < len(text):
            yield text[pos:]


def _progress(texts: Iterable[str], total: int | None, show: bool | None) -> Iterable[str]:
    if show is None:
        show = sys.stderr.isatty()
    if not show:
        return texts
    from tqdm.auto import tqdm

    return tqdm(texts, total=total, desc="train BPE", unit="doc", disable=not show)


def _train_once(texts: Iterable[str], cfg: TokenizerConfig, length: int | None) -> bytes:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=list(cfg.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return tok.to_str(pretty=True).encode("utf-8")


def train_bpe(
    texts: Iterable[str],
    cfg: TokenizerConfig,
    out_dir: str | os.PathLike,
    *,
    length: int | None = None,
    progress: bool | None = None,
    check_determinism: bool = False,
) -> TokenizerInfo:
    """Train a byte-level BPE on ``texts`` (in order) and write it to ``out_dir``.

    Args:
        texts: the training documents; only the first ``cfg.max_train_chars`` characters are used.
        cfg: vocab_size (special tokens included), min_frequency, special_tokens (the first is
            EOS, BOS and PAD).
        length: number of texts, if known (for the progress bar).
        progress: show a tqdm bar; None = only when stderr is a terminal.
        check_determinism: train a second time and raise if the result differs (doubles the cost;
            ``texts`` must then be re-iterable, e.g. a list).
    """
    if check_determinism and iter(texts) is texts:
        raise ValueError("check_determinism needs re-iterable texts (a list or tuple), not an iterator")
    stream = _split_long_words(_progress(_capped(texts, cfg.max_train_chars), length, progress))
    data = _train_once(stream, cfg, length)
    if check_determinism:
        again = _train_once(_split_long_words(_capped(texts, cfg.max_train_chars)), cfg, length)
        if again != data:
            raise TokenizerError("BPE training is not deterministic here: two runs on the same texts differ")
    first = cfg.special_tokens[0]
    roles = {"bos_token": first, "eos_token": first, "pad_token": first}
    return _write_dir(
        out_dir, data, roles, {"add_prefix_space": False}, additional=list(cfg.special_tokens[1:])
    )


# --- Hugging Face tokenizers ----------------------------------------------------------------


def _read_json(path: str) -> dict[str, Any]:
    text = fs.read_text(path)
    if text is None:
        return {}
    return _json_object(text, path)


def _json_object(text: str | bytes, path: str) -> dict[str, Any]:
    """The JSON object in ``text`` (read from ``path``; anything but an object: {}); a syntax error
    is a :class:`TokenizerError` naming the file, line and column."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"'{path}' is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); replace the "
                             "tokenizer directory with an intact copy") from None
    return data if isinstance(data, dict) else {}


def _parse_tokenizer(data: bytes, path: str):
    """The ``tokenizers.Tokenizer`` of the ``tokenizer.json`` bytes ``data`` (read from ``path``);
    a file it cannot load is a :class:`TokenizerError` naming the file and the parse error."""
    from tokenizers import Tokenizer

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"'{path}' is not a tokenizer file (not UTF-8 text: {e.reason} at byte {e.start}); "
                             "replace the tokenizer directory with an intact copy") from None
    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for a bad file
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise TokenizerError(f"'{path}' is not a tokenizer file the tokenizers library can load ({first}); replace "
                             "the tokenizer directory with an intact copy") from None


def load_hf_tokenizer(
    name_or_path: str,
    out_dir: str | os.PathLike,
    *,
    eos_token: str | None = None,
    revision: str | None = None,
) -> TokenizerInfo:
    """Bring a Hugging Face tokenizer into ``out_dir`` in the layout described above.

    A local directory with ``tokenizer.json`` is copied without transformers (``tokenizer.json``
    byte for byte; special tokens from its ``special_tokens_map.json`` / ``tokenizer_config.json``).
    Anything else (a hub name, a directory with only slow-tokenizer files) goes through
    ``transformers.AutoTokenizer`` and must yield a fast tokenizer. ``eos_token`` overrides (or
    supplies) the EOS token; it must be in the vocabulary.
    """
    from lm_pipeline.inputs import tokenizer_problem

    problem = tokenizer_problem(name_or_path)  # a local path that is missing, a file, or corrupt
    if problem:
        raise TokenizerError(f"data.tokenizer: {problem}")
    additional: list[str] = []
    source = fs.join(name_or_path, TOKENIZER_FILE)
    found = fs.read_bytes(source)
    if found is not None:  # a directory (local or on an object store) holding tokenizer.json
        data = found
        _parse_tokenizer(data, source)  # before its special tokens are looked for
        conf = _read_json(fs.join(name_or_path, CONFIG_FILE))
        smap = _read_json(fs.join(name_or_path, SPECIAL_MAP_FILE))
        roles = {r: _token_str(smap.get(r, conf.get(r))) for r in _ROLES}
        extra: dict[str, Any] = {}
        if isinstance(conf.get("model_max_length"), int):
            extra["model_max_length"] = conf["model_max_length"]
        from lm_pipeline.data.chat import chat_template_of

        template = chat_template_of(name_or_path)  # kept for chat sources (and the export)
        if template is not None:
            extra["chat_template"] = template
        additional = [
            t for t in (_token_str(v) for v in smap.get("additional_special_tokens", []) or []) if t
        ]
    else:
        def auto_tokenizer() -> Any:
            try:
                from transformers import AutoTokenizer
            except ImportError as e:  # pragma: no cover - depends on the environment
                raise TokenizerError(
                    f"{name_or_path!r} has no tokenizer.json; loading it needs transformers: pip install 'lm-pipeline[hf]'"
                ) from e
            return AutoTokenizer

        hf = _auto_tokenizer(auto_tokenizer, name_or_path, revision)
        source = name_or_path
        if not getattr(hf, "is_fast", False):
            raise TokenizerError(
                f"{name_or_path!r} has no fast (tokenizers) version; the pipeline needs tokenizer.json"
            )
        data = hf.backend_tokenizer.to_str(pretty=True).encode("utf-8")
        roles = {r: _token_str(getattr(hf, r, None)) for r in _ROLES}
        extra = {}
        mml = getattr(hf, "model_max_length", None)
        if isinstance(mml, int):
            extra["model_max_length"] = mml
        if isinstance(getattr(hf, "chat_template", None), str):  # kept for chat sources (and the export)
            extra["chat_template"] = hf.chat_template
    if eos_token is not None:
        roles["eos_token"] = eos_token
    if roles.get("eos_token") is None:
        raise TokenizerError(
            f"{name_or_path!r} defines no eos_token; set data.tokenizer.eos_token to one of its special tokens"
        )
    return _write_dir(out_dir, data, roles, extra, additional=additional, source=source)


def _auto_tokenizer(auto: Any, name_or_path: str, revision: str | None) -> Any:
    """``AutoTokenizer.from_pretrained`` of a local directory or a hub id, failing in one line:
    a hub id when the hub cannot be reached (checked once, in seconds: :mod:`lm_pipeline.hf.hub`)
    comes from the local Hugging Face cache or not at all."""
    from lm_pipeline.hf import hub

    local = fs.is_local_dir(name_or_path)
    offline = None if local else hub.unreachable()

    def not_cached() -> TokenizerError:
        return TokenizerError("data.tokenizer: " + hub.offline_message(
            "tokenizer", name_or_path, str(offline), "point data.tokenizer at a local directory holding its tokenizer.json"))

    if offline is not None and not hub.in_cache(name_or_path, ("tokenizer.json", "tokenizer_config.json"), revision):
        raise not_cached()  # before importing transformers (seconds) for nothing
    try:
        return auto().from_pretrained(name_or_path, revision=revision, local_files_only=offline is not None)
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, the hub client's errors: one line each
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if offline is not None:
            raise not_cached() from None
        where = "the directory" if local else "the hub id"
        raise TokenizerError(f"data.tokenizer: {where} {name_or_path!r} cannot be loaded as a tokenizer ({first}); "
                             "point data.tokenizer at a directory holding tokenizer.json, or at a hub id such as "
                             "'gpt2'") from None


def build_tokenizer(
    cfg: TokenizerConfig, out_dir: str | os.PathLike, texts: Iterable[str] | None = None, **kwargs: Any
) -> TokenizerInfo:
    """Train (``kind: bpe``, on ``texts``) or load (``kind: hf``) the configured tokenizer."""
    if cfg.kind == "hf":
        assert cfg.name_or_path is not None
        return load_hf_tokenizer(cfg.name_or_path, out_dir, eos_token=cfg.eos_token, revision=cfg.revision)
    if texts is None:
        raise ValueError("training a BPE tokenizer needs texts (the training shards' texts)")
    return train_bpe(texts, cfg, out_dir, **kwargs)


# --- loading --------------------------------------------------------------------------------


def load_tokenizer(path: str | os.PathLike):
    """The ``tokenizers.Tokenizer`` of a tokenizer directory (local or fsspec URL)."""
    file = fs.join(path, TOKENIZER_FILE)
    return _parse_tokenizer(fs.read_bytes(file, missing_ok=False), file)


def tokenizer_info(path: str | os.PathLike) -> TokenizerInfo:
    """Vocabulary size, EOS / BOS / PAD ids and what the tokenizer adds by itself."""
    base = os.fspath(path)
    data = fs.read_bytes(fs.join(base, TOKENIZER_FILE), missing_ok=False)
    tok = _parse_tokenizer(data, fs.join(base, TOKENIZER_FILE))
    conf_bytes = fs.read_bytes(fs.join(base, CONFIG_FILE))
    conf = {} if conf_bytes is None else _json_object(conf_bytes, fs.join(base, CONFIG_FILE))
    roles = {r: _token_str(conf.get(r)) for r in _ROLES}
    eos = roles["eos_token"]
    if eos is None or tok.token_to_id(eos) is None:
        raise TokenizerError(f"{base}: {CONFIG_FILE} names no eos_token in the vocabulary")
    eos_id = tok.token_to_id(eos)
    bos = roles["bos_token"]
    bos_id = tok.token_to_id(bos) if bos is not None else None
    pad_id = tok.token_to_id(roles["pad_token"]) if roles["pad_token"] is not None else None
    with_special = tok.encode(_PROBE, add_special_tokens=True).ids
    plain = tok.encode(_PROBE, add_special_tokens=False).ids
    adds_bos = (
        bos_id is not None and bool(with_special) and with_special[0] == bos_id and plain[:1] != [bos_id]
    )
    adds_eos = bool(with_special) and with_special[-1] == eos_id and plain[-1:] != [eos_id]
    sha = hashlib.sha256(data)
    sha.update(json.dumps({k: v for k, v in roles.items() if v is not None}, sort_keys=True).encode())
    return TokenizerInfo(
        path=base,
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        eos_token=eos,
        eos_id=eos_id,
        bos_token=bos if bos_id is not None else None,
        bos_id=bos_id,
        pad_id=pad_id,
        adds_bos=adds_bos,
        adds_eos=adds_eos,
        fingerprint=sha.hexdigest(),
    )
