"""Chat-formatted sources (Levanter's ``format: {type: chat}``): conversations rendered through a
chat template into token ids and a per-token loss mask.

A chat record holds a list of messages (``{"role": ..., "content": ...}``) under
``format.messages_field``. The reader passes the list on as its JSON text (so the record
validation, the shard fingerprints and the worker queues stay those of text); the cache builder
renders it here:

* **Multi-turn** (the default): the conversation is rendered with the Jinja chat template
  (``format.chat_template``, else the tokenizer's own from ``tokenizer_config.json`` or
  ``chat_template.jinja``) the way ``transformers``' ``apply_chat_template`` renders it: a
  sandboxed environment with ``trim_blocks`` / ``lstrip_blocks``, the ``tojson`` filter,
  ``raise_exception`` and ``strftime_now``, ``add_generation_prompt`` false, the tokenizer's
  special tokens (``bos_token``, ``eos_token``, ...) as variables. The text is tokenized with the
  special tokens it contains recognised and nothing added (the template writes BOS/EOS itself).
  The template marks the assistant's text with ``{% generation %} ... {% endgeneration %}``; the
  loss mask is 1 on every token from the one holding a block's first character through the one
  holding its last, 0 elsewhere (``mask_user_turns: false``: 1 everywhere).
* **Single turn** (``single_turn: true``, Levanter's supervised form): the first user message's
  content followed by the first assistant message's, tokenized as one text the cache's text way
  (what the tokenizer adds, then EOS); the mask is 1 from the first token past the user text's
  own tokens on (the whole document when ``mask_user_turns: false``). No template.

A conversation that cannot be trained on (its mask holds no 1: no assistant text; the template's
``raise_exception(...)``; a single-turn message without string content) is an invalid record
(``bad_conversation``, :meth:`ChatRenderer.check`): an error naming the file and line, or skipped
and counted under ``data.on_invalid: skip``.
Nothing is appended to a rendered conversation: it ends where the template ends it.
"""

from __future__ import annotations

import collections
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from lm_pipeline import fs

__all__ = ["ChatSettings", "GENERATION_TAG", "ChatRenderer", "chat_pack", "chat_settings", "chat_template_of",
           "has_generation_tag", "messages_problem"]

MASK_DTYPE = np.uint8
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_tag(template: str) -> bool:
    """Whether ``template`` marks the assistant's text with ``{% generation %}``."""
    return bool(GENERATION_TAG.search(template))


def chat_template_of(tokenizer_dir: str) -> str | None:
    """The chat template a tokenizer directory carries: ``chat_template.jinja``, else
    ``tokenizer_config.json``'s ``chat_template`` (a string, or the one named ``default`` of a
    list of named templates); None when it has none."""
    raw = fs.read_bytes(fs.join(tokenizer_dir, "chat_template.jinja"))
    if raw:
        return raw.decode("utf-8")
    cfg = json.loads(fs.read_bytes(fs.join(tokenizer_dir, "tokenizer_config.json")) or "{}")
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):
        tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None)
    return tpl if isinstance(tpl, str) and tpl else None


@dataclass(frozen=True)
class ChatSettings:
    """What the cache builder needs of a chat source (picklable; recorded in the ledger)."""

    template: str | None  # the effective template (None for single_turn)
    mask_user_turns: bool = True
    single_turn: bool = False
    pack: bool = True
    messages_field: str = "messages"

    def ledger(self) -> dict[str, Any]:
        """The ledger's ``settings.chat``: everything that changes the ids or the mask (not
        ``pack``: how the rows are packed is decided when the cache is read, see
        :func:`chat_pack`, so runs that differ only in it share the cache)."""
        return {"template_sha256": hashlib.sha256((self.template or "").encode()).hexdigest(),
                "mask_user_turns": self.mask_user_turns, "single_turn": self.single_turn,
                "messages_field": self.messages_field, "mask_dtype": np.dtype(MASK_DTYPE).name}


def messages_problem(value: Any) -> str | None:
    """Why ``value`` is not a conversation (a non-empty list of messages, each a mapping with a
    string ``role``), or None."""
    if not isinstance(value, list) or not value:
        return f"expected a non-empty list of messages, got {type(value).__name__}" + (" (empty)" if value == [] else "")
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            return f"message {i} is {type(m).__name__}, not a mapping with 'role' and 'content'"
        if not isinstance(m.get("role"), str):
            return f"message {i} has no string 'role'"
    return None


def _sandbox(template: str):
    """The compiled template and a function that renders it, recording the ``{% generation %}``
    blocks' character spans in the output."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    state: dict[str, Any] = {"out": None, "spans": None}

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            if state["spans"] is not None:
                start = sum(map(len, state["out"]))
                state["spans"].append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        import datetime

        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    compiled = env.from_string(template)

    def render(messages: list[dict[str, Any]], variables: dict[str, Any]) -> tuple[str, list[tuple[int, int]]]:
        out: list[str] = []
        spans: list[tuple[int, int]] = []
        state["out"], state["spans"] = out, spans
        try:
            for block in compiled.generate(messages=messages, tools=None, documents=None,
                                           add_generation_prompt=False, **variables):
                out.append(block)
        finally:
            state["out"], state["spans"] = None, None
        return "".join(out), spans

    return render


def _special_variables(tokenizer_dir: str) -> dict[str, str]:
    """The tokenizer's special tokens as template variables (``bos_token``, ``eos_token``, ...)."""
    cfg = json.loads(fs.read_bytes(fs.join(tokenizer_dir, "tokenizer_config.json")) or "{}")
    out = {}
    for name in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        v = cfg.get(name)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            out[name] = v
    return out


class ChatRenderer:
    """Renders conversations into (ids, mask) with a tokenizer directory and :class:`ChatSettings`."""

    def __init__(self, tokenizer_dir: str, settings: ChatSettings, text_tok: Any, info: Any):
        from tokenizers import Tokenizer

        self.settings = settings
        self.text_tok = text_tok  # special-token strings stay text (the cache's document encoding)
        self.info = info  # the cache's TokenizerInfo (EOS, what the post-processor adds)
        raw = fs.read_bytes(fs.join(tokenizer_dir, "tokenizer.json"), missing_ok=False).decode("utf-8")
        self.chat_tok = Tokenizer.from_str(raw)  # the template's special tokens recognised
        self.chat_tok.no_padding()
        self.chat_tok.no_truncation()
        self.variables = _special_variables(tokenizer_dir)
        self._render: Callable | None = None
        self._checked: collections.deque = collections.deque()  # (text, rendering) of check()
        if not settings.single_turn:
            if not settings.template:
                raise ValueError("a chat source needs a chat template (format.chat_template)")
            self._render = _sandbox(settings.template)

    def check(self, record_json: str) -> str | None:
        """Why a conversation cannot be trained on (no assistant text, the template's
        ``raise_exception(...)``, a single-turn message without string content, a template that
        fails on it), or None: the record validation's further check (``bad_conversation``), so
        such a record is named by file and line, or skipped and counted under ``on_invalid: skip``.
        The rendering is kept for :meth:`encode` of the same text (valid texts come in order)."""
        import jinja2

        try:
            out = self._encode(record_json)
        except (ValueError, TypeError, KeyError, AttributeError, jinja2.TemplateError) as e:
            kind = "the chat template raised" if isinstance(e, jinja2.TemplateError) else "it"
            return f"the conversation cannot be trained on: {kind}: {' '.join(str(e).split())}"
        self._checked.append((record_json, out))
        return None

    def encode(self, record_json: str) -> tuple[list[int], np.ndarray, int]:
        """(ids, mask, bytes) of one conversation given as its messages' JSON text; bytes: the
        UTF-8 bytes of the text the masked-in tokens stand for (the assistant's text; all of the
        rendered text when ``mask_user_turns`` is false), for bits per byte."""
        while self._checked:  # rendered by check(): valid texts come in the order checked
            text, out = self._checked.popleft()
            if text is record_json:
                return out
        return self._encode(record_json)

    def _encode(self, record_json: str) -> tuple[list[int], np.ndarray, int]:
        messages = json.loads(record_json)
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        if self.settings.single_turn:
            return self._single_turn(messages)
        text, spans = self._render(messages, self.variables)
        enc = self.chat_tok.encode(text, add_special_tokens=False)
        ids = enc.ids
        mask = np.zeros(len(ids), MASK_DTYPE)
        if not self.settings.mask_user_turns:
            mask[:] = 1
            return ids, mask, len(text.encode("utf-8"))
        for start, end in spans:
            if end <= start:
                continue
            first = enc.char_to_token(start)
            last = enc.char_to_token(end - 1)
            if first is None:
                continue
            mask[first : (last + 1 if last is not None else len(ids))] = 1
        if not mask.any():
            raise ValueError("the conversation has no assistant text to train on (the template's "
                             "{% generation %} blocks are empty or absent)")
        return ids, mask, sum(len(text[a:b].encode("utf-8")) for a, b in spans)

    def _single_turn(self, messages: list[dict[str, Any]]) -> tuple[list[int], np.ndarray]:
        user = next((m.get("content") for m in messages if m.get("role") == "user"), None)
        reply = next((m.get("content") for m in messages if m.get("role") == "assistant"), None)
        if not isinstance(user, str) or not isinstance(reply, str):
            raise ValueError("single_turn: the conversation needs a 'user' and an 'assistant' message with string content")
        whole = self.text_tok.encode(user + reply, add_special_tokens=True).ids
        ids = list(whole) + ([self.info.eos_id] if self.info.append_eos else [])
        # what the tokenizer puts before a text, then the user text's own tokens: not trained on
        prompt_len = min(len(self.info.prefix_ids) + len(self.text_tok.encode(user, add_special_tokens=False).ids),
                         len(ids))
        mask = np.ones(len(ids), MASK_DTYPE)
        if self.settings.mask_user_turns:
            mask[:prompt_len] = 0
            nbytes = len(reply.encode("utf-8"))
        else:
            nbytes = len((user + reply).encode("utf-8"))
        if not mask.any():
            raise ValueError("single_turn: the assistant message has no tokens")
        return ids, mask, nbytes




def chat_settings(chat_cfg: Any, tokenizer_dir: str | None, *, where: str = "",
                  fallback: Callable[[], tuple[str | None, str]] | None = None) -> ChatSettings:
    """The :class:`ChatSettings` of a source's ``chat`` config with the tokenizer at
    ``tokenizer_dir`` (its template when the config gives none). Raises a one-line
    :class:`~lm_pipeline.schema.ConfigError` naming ``<where>chat.chat_template`` when there is
    no template, when the one found does not compile (a Jinja syntax error: its message and
    line), or when it cannot mark the assistant's tokens."""
    from lm_pipeline.schema import ConfigError

    template = None
    if not chat_cfg.single_turn:
        template = chat_cfg.chat_template
        source = "format.chat_template"
        if template is None and tokenizer_dir is not None:
            template = chat_template_of(tokenizer_dir)
            source = f"the tokenizer's chat template ({tokenizer_dir})"
        if template is None and fallback is not None:  # (template, where it was read) elsewhere
            template, source = fallback()
        if template is None:
            raise ConfigError(f"{where}chat.chat_template", f"is needed: the tokenizer ({tokenizer_dir}) has no chat "
                              "template (no chat_template in its tokenizer_config.json, no chat_template.jinja); set "
                              "format.chat_template to a Jinja template with {% generation %} around the assistant's "
                              "content")
        try:  # compiled here, so a syntax error is a config error before anything is built
            _sandbox(template)
        except Exception as e:
            import jinja2

            if not isinstance(e, jinja2.TemplateSyntaxError):
                raise
            raise ConfigError(f"{where}chat.chat_template", f"{source} is not a valid Jinja template: "
                              f"{' '.join(str(e.message).split())} (template line {e.lineno})") from None
        if chat_cfg.mask_user_turns and not has_generation_tag(template):
            raise ConfigError(f"{where}chat.chat_template", f"{source} has no {{% generation %}} block, so the "
                              "assistant's tokens cannot be told apart: give format.chat_template with "
                              "{% generation %}...{% endgeneration %} around the assistant's content, or set "
                              "format.mask_user_turns: false")
    return ChatSettings(template, chat_cfg.mask_user_turns, chat_cfg.single_turn, chat_cfg.pack,
                        chat_cfg.messages_field)


def chat_pack(source_cfg: Any) -> bool | None:
    """A chat source's ``pack`` (whole conversations packed greedily, else one per row), read
    when its cache is opened; None for a text source."""
    chat_cfg = getattr(source_cfg, "chat", None)
    return None if chat_cfg is None else bool(chat_cfg.pack)


def source_chat(data_cfg: Any, tokenizer_dir: str | None) -> ChatSettings | None:
    """The chat settings of a (single-source) data section, None for text. ``tokenizer_dir``: the
    tokenizer artifact; the template is read from the configured directory when the tokenizer is a
    local one (what the fingerprint hashes), else from the artifact (a hub tokenizer's copy)."""
    chat_cfg = getattr(data_cfg, "chat", None)
    if chat_cfg is None:
        return None
    tok = data_cfg.tokenizer
    fallback = None
    if tok.kind != "bpe" and tok.name_or_path and fs.exists(fs.join(tok.name_or_path, "tokenizer.json")):
        tokenizer_dir = tok.name_or_path
    elif tok.kind != "bpe" and tok.name_or_path:
        # A hub tokenizer: its template is copied into the tokenizer artifact, but an artifact stored
        # before the copy existed (the same address: the stage's code version was not bumped, which
        # would move every experiment's tokenizer) has none: then it is read from the source.
        def fallback() -> tuple[str | None, str]:
            return source_template(tok), f"the tokenizer's chat template ({tok.name_or_path})"
    return chat_settings(chat_cfg, tokenizer_dir, where="data.", fallback=fallback)


def source_template(tok: Any) -> str | None:
    """The chat template of a given (not trained) tokenizer read from its source, the way the
    ``tokenizer`` stage reads it (:func:`lm_pipeline.data.tokenizer.load_hf_tokenizer`: a hub id
    through ``transformers``, its revision, from the local Hugging Face cache when offline)."""
    import tempfile

    from lm_pipeline.data.tokenizer import load_hf_tokenizer

    with tempfile.TemporaryDirectory(prefix="lm_pipeline_chat_template_") as tmp:
        load_hf_tokenizer(tok.name_or_path, tmp, eos_token=tok.eos_token, revision=tok.revision)
        return chat_template_of(tmp)


def chat_template_problems(data_cfg: Any) -> list[Any]:
    """One :class:`~lm_pipeline.schema.ConfigError` per chat source (the section's own or a
    mixture component's) that has no usable template, checked before anything is built: the
    config's template, else a local tokenizer directory's (a hub tokenizer's is checked when its
    cache is built; a BPE trained here has none, refused when the config is read)."""
    from lm_pipeline.schema import ConfigError

    sources = data_cfg.chat_sources() if hasattr(data_cfg, "chat_sources") else {}
    tok = data_cfg.tokenizer
    local = None
    if tok.kind != "bpe" and tok.name_or_path and fs.exists(fs.join(tok.name_or_path, "tokenizer.json")):
        local = tok.name_or_path
    out = []
    for where, src in sources.items():
        if src.chat.chat_template is None and local is None:
            continue  # a hub tokenizer (checked at build), or a BPE (refused by the config)
        try:
            chat_settings(src.chat, local, where=f"data.{where}")
        except ConfigError as e:
            out.append(e)
    return out
