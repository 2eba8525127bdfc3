"""Typed configuration schema: field declarations, strict dict -> dataclass conversion.

Every config section is a frozen dataclass whose fields are declared with :func:`field`.
Each field carries a help text and a ``semantic`` flag: semantic fields can change the bytes
of an artifact and therefore enter its fingerprint; the others (log cadence, worker counts,
trackers, progress display, paths of the store) are excluded explicitly.

Conversion from plain data (parsed YAML) is strict: unknown keys, wrong types and failed
validations raise :class:`ConfigError` naming the dotted field path and what would be valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Sequence
from typing import Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin

T = TypeVar("T")

MISSING = dataclasses.MISSING


class ConfigError(ValueError):
    """A configuration problem, with the dotted path of the offending field."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message
        where = f"config field '{path}'" if path else "config"
        super().__init__(f"{where}: {message}")

    def prefixed(self, prefix: str) -> ConfigError:
        if not prefix:
            return self
        return ConfigError(f"{prefix}.{self.path}" if self.path else prefix, self.message)


class ConfigProblems(ConfigError):
    """Several problems of one config, reported together: ``problems`` holds one
    :class:`ConfigError` per problem, each naming its field; ``path`` is the first one's."""

    def __init__(self, problems: Sequence[ConfigError]):
        self.problems = tuple(problems)
        self.path = self.problems[0].path
        self.message = "; ".join(f"'{p.path}': {p.message}" for p in self.problems)
        ValueError.__init__(self, f"{len(self.problems)} problems: " + "; ".join(str(p) for p in self.problems))

    def prefixed(self, prefix: str) -> ConfigProblems:
        return ConfigProblems([p.prefixed(prefix) for p in self.problems])


def flat_problems(problems: Sequence[ConfigError]) -> list[ConfigError]:
    """Each single problem of ``problems`` (a :class:`ConfigProblems` contributes each of its own)."""
    return [q for p in problems for q in (p.problems if isinstance(p, ConfigProblems) else (p,))]


def raise_problems(problems: Sequence[ConfigError]) -> None:
    """Raise the one problem as it is, several as one :class:`ConfigProblems`; nothing if none."""
    problems = flat_problems(problems)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ConfigProblems(problems)


def field(
    default: Any = MISSING,
    *,
    default_factory: Any = MISSING,
    help: str,
    semantic: bool = True,
    aliases: tuple[str, ...] = (),
    hashed_at_default: bool = True,
) -> Any:
    """Declare a config field.

    Args:
        default / default_factory: as for :func:`dataclasses.field`.
        help: one sentence for the generated configuration reference.
        semantic: True if the value can change an artifact's bytes (it enters fingerprints).
        aliases: other names accepted for this key (e.g. Levanter's spelling).
        hashed_at_default: False for a semantic field added after artifacts were built: it enters
            fingerprints only when set to another value than its default, so every existing
            address stays what it was.
    """
    meta = {"help": help, "semantic": semantic, "aliases": tuple(aliases), "hashed_at_default": hashed_at_default}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


class Choice:
    """Base for config families selected by a ``type:`` key (models, trackers, ...).

    Subclass once per family and set ``default_type``; register members with
    ``@Family.register("name")``. Members must declare ``type`` as their first field.
    """

    registry: ClassVar[dict[str, type]]
    default_type: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if Choice in cls.__bases__:
            cls.registry = {}

    @classmethod
    def register(cls, name: str):
        def deco(sub: type[T]) -> type[T]:
            cls.registry[name] = sub
            return sub

        return deco

    @classmethod
    def family(cls) -> type[Choice]:
        for klass in cls.__mro__:
            if Choice in klass.__bases__:
                return klass
        raise TypeError(f"{cls} is not a Choice family")


def fields_of(cls: type) -> list[dataclasses.Field]:
    return list(dataclasses.fields(cls))


def type_name(tp: Any) -> str:
    """A field type as readers of the configuration reference and of errors say it:
    ``int | None`` -> ``'integer or null'``, a dataclass -> ``'mapping'``."""
    if tp is type(None):
        return "null"
    if isinstance(tp, type):
        if dataclasses.is_dataclass(tp):
            return "mapping"
        return {"int": "integer", "float": "number", "str": "string", "bool": "boolean"}.get(
            tp.__name__, tp.__name__
        )
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in get_args(tp))
    if origin in (list, tuple):
        return f"list of {type_name(get_args(tp)[0])}" if get_args(tp) else "list"
    if origin is dict:
        return f"mapping of {type_name(get_args(tp)[1])}"
    return str(tp)


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_NO = object()


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Convert ``value`` to type ``tp`` strictly; raise ConfigError on mismatch."""
    if tp is Any:
        return value
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(path, f"must not be null; expected {type_name(tp)}")
        errors = []
        # Try exact-kind matches first so that `int | float` keeps ints as ints.
        for arg in sorted(args, key=lambda a: 0 if isinstance(a, type) and type(value) is a else 1):
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, path)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(path, f"expected {type_name(tp)}, got {_describe(value)}")
    if origin is Literal:
        allowed = get_args(tp)
        if value in allowed:
            return value
        hint = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
        extra = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(path, f"must be one of {', '.join(map(repr, allowed))}, got {_describe(value)}{extra}")
    if origin in (list, tuple):
        (item_tp, *_) = get_args(tp) or (Any,)
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected {type_name(tp)}, got {_describe(value)}")
        return tuple(_convert(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        key_tp, val_tp = get_args(tp) or (str, Any)
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected {type_name(tp)}, got {_describe(value)}")
        return {_convert(key_tp, k, path): _convert(val_tp, v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, Choice):
        return _from_choice(tp, value, path)
    if dataclasses.is_dataclass(tp):
        if dataclasses.is_dataclass(value) and isinstance(value, tp):
            return value
        return from_dict(tp, value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected a boolean (true/false), got {_describe(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            return int(value)
        raise ConfigError(path, f"expected an integer, got {_describe(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:  # YAML 1.1 reads "6e-4" as a string; accept numeric strings.
                return float(value)
            except ValueError:
                pass
        raise ConfigError(path, f"expected a number, got {_describe(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(path, f"expected a string, got {_describe(value)}")
    raise TypeError(f"unsupported config type {tp!r} at {path}")


def _from_choice(base: type[Choice], value: Any, path: str) -> Any:
    family = base.family()
    if dataclasses.is_dataclass(value) and isinstance(value, family):
        return value
    if not isinstance(value, dict):
        raise ConfigError(path, f"expected a mapping with a 'type' key, got {_describe(value)}")
    kind = value.get("type", family.default_type if base is family else None)
    if kind is None:
        kind = next((k for k, c in family.registry.items() if c is base), None)
    if not isinstance(kind, str) or kind not in family.registry:  # a list or mapping is no type name
        names = sorted(family.registry)
        from lm_pipeline import levanter

        known = levanter.model_type_refusal(kind, names) if path == "model" and isinstance(kind, str) else None
        if known is not None:
            raise ConfigError(f"{path}.type", known)
        hint = difflib.get_close_matches(str(kind), names, n=1)
        extra = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(f"{path}.type" if path else "type", f"unknown type {kind!r}; valid: {', '.join(names)}{extra}")
    data = dict(value)
    data["type"] = kind
    return from_dict(family.registry[kind], data, path)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, strictly, then run its ``validate()``."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(path, f"expected a mapping, got {_describe(data)}")
    normalize = getattr(cls, "normalize_raw", None)
    if normalize is not None:  # a section may rewrite its raw mapping first (shorthands, aliases)
        try:
            data = normalize(dict(data))
        except ConfigError as e:
            raise e.prefixed(path) from None
    hints = _hints(cls)
    flds = {f.name: f for f in dataclasses.fields(cls) if f.init}
    alias_of = {a: f.name for f in flds.values() for a in f.metadata.get("aliases", ())}
    kwargs: dict[str, Any] = {}
    problems: list[ConfigError] = []
    for key, value in data.items():
        name = alias_of.get(key, key)
        sub = f"{path}.{key}" if path else str(key)
        if name not in flds:
            problem = _unknown_key(sub, key, value, sorted(flds), sorted(alias_of))
            if problem is not None:
                problems.append(problem)
            continue
        if name in kwargs:
            problems.append(ConfigError(sub, f"given twice (as {name!r} and an alias)"))
            continue
        try:
            kwargs[name] = _convert(hints[name], value, f"{path}.{name}" if path else name)
        except ConfigError as e:
            problems.append(e)
    for name, f in flds.items():
        if name not in kwargs and name not in data and f.default is MISSING and f.default_factory is MISSING:
            problems.append(ConfigError(f"{path}.{name}" if path else name, "is required"))
    raise_problems(problems)
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        try:
            validate()
        except ConfigError as e:
            raise e.prefixed(path) from None
    return obj


def _unknown_key(path: str, key: Any, value: Any, names: list[str], aliases: list[str]) -> ConfigError | None:
    """The problem of a key that is no field here: Levanter's own keys say what they do and what to
    do instead (or are accepted with a log line when they change nothing here: None); any other key
    is unknown, with a suggestion only for a near-miss spelling."""
    from lm_pipeline import levanter

    known = levanter.levanter_key(path)
    if known is not None:
        if known.status == "no_effect" or (value is None and known.path in levanter.NULL_IS_DEFAULT):
            levanter.accept(known, path)
            return None
        return ConfigError(path, levanter.refusal(known, path))
    hint = difflib.get_close_matches(str(key), names + aliases, n=1, cutoff=0.8)
    extra = f"; did you mean {hint[0]!r}?" if hint else "."
    return ConfigError(path, f"unknown key{extra} Valid keys here: {', '.join(names)}")


def to_dict(cfg: Any, *, semantic_only: bool = False) -> Any:
    """Plain-data form of a config (lists for tuples); ``semantic_only`` drops non-semantic fields."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        out = {}
        for f in dataclasses.fields(cfg):
            if semantic_only and not f.metadata.get("semantic", True):
                continue
            if semantic_only and not f.metadata.get("hashed_at_default", True) and _is_default(f, getattr(cfg, f.name)):
                continue
            out[f.name] = to_dict(getattr(cfg, f.name), semantic_only=semantic_only)
        return out
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v, semantic_only=semantic_only) for v in cfg]
    if isinstance(cfg, dict):
        return {str(k): to_dict(v, semantic_only=semantic_only) for k, v in cfg.items()}
    return cfg


def _is_default(f: dataclasses.Field, value: Any) -> bool:
    default = f.default_factory() if f.default_factory is not MISSING else f.default
    return value == default


def replace(cfg: T, **changes: Any) -> T:
    """``dataclasses.replace`` that re-runs validation."""
    new = dataclasses.replace(cfg, **changes)
    validate = getattr(new, "validate", None)
    if validate is not None:
        validate()
    return new
