"""Typed config groups: a dataclass is a group's schema, its defaults and its documentation.

A config group (``train``, ``scene``, ``export``, ``search`` ...) is a dataclass whose fields are
its keys, in the style of nerfstudio's configs: the annotation is the key's type, the default
its default, the docstring under the field what it means. A check that the type cannot say (a
range, a set of names, a relation to another key) is written next to the field, once, with
:func:`setting`, out of the validators below: one per kind of value, shared by every group.

======================  =========================================================
:class:`Integer`        an integer, optionally in a range (``Integer(min=0)``)
:class:`Number`         a finite int or float, optionally in a range
:class:`Flag`           true or false
:class:`OneOf`          one of a set of values
:class:`Text`           a string
:class:`FilePath`       a file or folder path (a non-empty string)
:class:`Name`           a name of letters, digits and ``_``
:class:`ListOf`         a list of values of one kind
:class:`Table`          a free-form mapping (a library's options)
:class:`OrNull`         null, or a value of another kind
:class:`AnyOf`          a value of one of several kinds
:class:`Group`          a nested group (another schema)
======================  =========================================================

A field without a validator gets the one its annotation names (``bool``: :class:`Flag`,
``int``: :class:`Integer`, ``float``: :class:`Number`, ``str``: :class:`Text`, ``X | None``:
:class:`OrNull`, ``list[X]``: :class:`ListOf`, ``dict``: :class:`Table`, a dataclass:
:class:`Group`).

:func:`check_group` reads a plain mapping (a composed Hydra group, after :func:`plain`) against
a schema: unknown keys, required values, each value, then each field's relation to the others.
The first failure is a :class:`ConfigError` of one line, ``"<group>.<key>: expected <what>, got
<value>"``. The dataclasses are OmegaConf structured configs too
(``OmegaConf.structured(TrainConfig)``), but the checks run here on the composed values:
OmegaConf's own type errors span several lines and name the keys its own way.

This module imports nothing of mptex above the core, so every layer may use it.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from mptex.numbers import as_int, is_number

__all__ = [
    "REQUIRED",
    "ConfigError",
    "plain",
    "is_int",
    "is_number",
    "Check",
    "Integer",
    "Number",
    "Flag",
    "OneOf",
    "Text",
    "FilePath",
    "Name",
    "ListOf",
    "Table",
    "OrNull",
    "AnyOf",
    "Group",
    "SEED",
    "setting",
    "defaults_of",
    "keys_of",
    "check_keys",
    "check_fields",
    "check_group",
]

REQUIRED = "???"  # OmegaConf's MISSING: a value the user must give


class ConfigError(ValueError):
    """A bad config value: ``"<key>: <message>"``, one line."""


def plain(cfg: Any) -> Any:
    """``cfg`` with OmegaConf containers turned into plain dicts and lists, interpolations
    resolved (a mandatory ``???`` value stays ``"???"``); anything else unchanged.

    Raises:
        ConfigError: ``"<key>: <message>"`` when a resolver raised a ``ValueError`` (the
            real-asset suite's path without pybullet_data): one line naming the key, not
            OmegaConf's multi-line report.
    """
    try:
        from omegaconf import OmegaConf
        from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return cfg
    if not OmegaConf.is_config(cfg):
        return cfg
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except InterpolationResolutionError as exc:
        cause = exc.__context__  # OmegaConf re-raises inside its handlers: walk the chain
        while isinstance(cause, OmegaConfBaseException):
            cause = cause.__context__
        if not isinstance(cause, ValueError):
            raise
        raise ConfigError(f"{exc.full_key}: {cause}") from None


def is_int(value: Any) -> bool:
    """An int or a numpy integer, not a bool (YAML's ``true`` is no count):
    :func:`mptex.numbers.as_int` has a value for it."""
    return as_int(value) is not None


# ----------------------------------------------------------------------------- validators
class Check:
    """One kind of value. ``check(value, key)`` returns the value (normalised where the kind
    says so) or raises :class:`ConfigError` ``"<key>: expected <what>, got <value>"``.

    Args (every kind):
        what: the expectation in words, instead of the kind's own (``"auto, cpu, cuda or
            cuda:N"`` says more than ``"a string"``).
        note: a remark appended in parentheses (``"0: only at the end"``).
    """

    def __init__(self, *, what: str | None = None, note: str | None = None) -> None:
        self._what, self._note = what, note

    @property
    def what(self) -> str:
        text = self._what or self.describe()
        return f"{text} ({self._note})" if self._note else text

    def describe(self) -> str:
        raise NotImplementedError

    def accepts(self, value: Any) -> bool:
        raise NotImplementedError

    def convert(self, value: Any) -> Any:
        return value

    def __call__(self, value: Any, key: str) -> Any:
        if not self.accepts(value):
            self.fail(value, key)
        return self.convert(value)

    def fail(self, value: Any, key: str) -> typing.NoReturn:
        raise ConfigError(f"{key}: expected {self.what}, got {value!r}")


def _bound(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


_INT64_MAX = 2**63 - 1


class _InRange(Check):
    """A value of a numeric type between ``min`` and ``max``, each bound closed unless
    ``min_open`` / ``max_open``; either may be left out. Subclasses say the type."""

    noun = "a number"  # with both bounds: "<noun> in [min, max]"
    open_noun = "a number"  # with one bound or none: "<open_noun> >= min"

    def __init__(self, min: float | None = None, max: float | None = None, *,
                 min_open: bool = False, max_open: bool = False, **words: str) -> None:  # fmt: skip
        super().__init__(**words)
        self.min, self.max, self.min_open, self.max_open = min, max, min_open, max_open

    def is_type(self, value: Any) -> bool:
        raise NotImplementedError

    def describe(self) -> str:
        if self.min is not None and self.max is not None:
            low, high = "(" if self.min_open else "[", ")" if self.max_open else "]"
            return f"{self.noun} in {low}{_bound(self.min)}, {_bound(self.max)}{high}"
        if self.min is not None:
            return f"{self.open_noun} {'>' if self.min_open else '>='} {_bound(self.min)}"
        if self.max is not None:
            return f"{self.open_noun} {'<' if self.max_open else '<='} {_bound(self.max)}"
        return self.open_noun

    def accepts(self, value: Any) -> bool:
        if not self.is_type(value):
            return False
        if self.min is not None and (value <= self.min if self.min_open else value < self.min):
            return False
        return self.max is None or (value < self.max if self.max_open else value <= self.max)


class Integer(_InRange):
    """An integer (not a bool: YAML's ``true`` is no count), optionally in a range
    (``Integer(min=0)``, ``Integer(1, 16)``)."""

    noun = open_noun = "an integer"

    def is_type(self, value: Any) -> bool:
        return is_int(value)

    def accepts(self, value: Any) -> bool:
        # Counts and sizes become torch sizes and int64 tensors: where no bound of its own
        # says otherwise, a value beyond a 64-bit integer is refused here, not overflowed in
        # torch's allocators mid-start.
        if not super().accepts(value):
            return False
        return (self.max is not None or value <= _INT64_MAX) and (
            self.min is not None or value >= -_INT64_MAX - 1
        )

    def fail(self, value: Any, key: str) -> typing.NoReturn:
        if super().accepts(value):  # in its own range, beyond int64's
            raise ConfigError(
                f"{key}: expected {self.what} and within a 64-bit integer's range "
                f"(|value| < 2**63), got {value!r}"
            )
        super().fail(value, key)

    def convert(self, value: Any) -> int:
        return int(value)  # a numpy integer becomes a Python int (JSON, Hydra, tcnn take it)


class Number(_InRange):
    """A finite int or float (not a bool: YAML's ``true`` is no learning rate), optionally in
    a range (``Number(min=0, min_open=True)``: > 0, ``Number(0, 1)``)."""

    noun, open_noun = "a number", "a finite number"

    def is_type(self, value: Any) -> bool:
        return is_number(value)


class Flag(Check):
    """``true`` or ``false`` (a bool; the string ``"no"`` is not false)."""

    def describe(self) -> str:
        return "true or false"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, bool)


class OneOf(Check):
    """One of ``choices``, of the same type (``True`` is not ``1``)."""

    def __init__(self, choices: Sequence[Any], **words: str) -> None:
        super().__init__(**words)
        self.choices = tuple(choices)

    def describe(self) -> str:
        return f"one of {list(self.choices)}"

    def accepts(self, value: Any) -> bool:
        return any(type(value) is type(c) and value == c for c in self.choices)


class Text(Check):
    """A string (``non_empty``: not ``""``)."""

    def __init__(self, *, non_empty: bool = False, **words: str) -> None:
        super().__init__(**words)
        self.non_empty = non_empty

    def describe(self) -> str:
        return "a non-empty string" if self.non_empty else "a string"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, str) and (value != "" or not self.non_empty)


class FilePath(Text):
    """A file or folder path: a non-empty string (whether it exists is the user's check:
    a config may be written before its files)."""

    def __init__(self, **words: str) -> None:
        super().__init__(non_empty=True, **words)

    def describe(self) -> str:
        return "a file or folder path"


class Name(Check):
    """A name of letters, digits and ``_`` (a Python identifier: it names a file and a
    Hydra option)."""

    def describe(self) -> str:
        return "a name of letters, digits and _"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, str) and value.isidentifier()


class ListOf(Check):
    """A list (or tuple) whose every item is an ``item``; returned as a list.

    Args:
        item: the kind of every item.
        length: the exact number of items, if fixed.
        non_empty: at least one item.
        unique: duplicates are dropped (first kept).
        comma_text: a string ``"a,b"`` is read as ``["a", "b"]`` (a command-line spelling).
    """

    def __init__(self, item: Check, *, length: int | None = None, non_empty: bool = False,
                 unique: bool = False, comma_text: bool = False, **words: str) -> None:  # fmt: skip
        super().__init__(**words)
        self.item, self.length, self.non_empty = item, length, non_empty
        self.unique, self.comma_text = unique, comma_text

    def describe(self) -> str:
        size = f"{self.length} " if self.length is not None else ""
        non_empty = "non-empty " if self.non_empty else ""
        return f"a {non_empty}list of {size}values, each {self.item.what}"

    def _items(self, value: Any) -> list[Any] | None:
        if self.comma_text and isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return list(value) if isinstance(value, (list, tuple)) else None

    def accepts(self, value: Any) -> bool:
        items = self._items(value)
        return (
            items is not None
            and (self.length is None or len(items) == self.length)
            and (bool(items) or not self.non_empty)
            and all(self.item.accepts(v) for v in items)
        )

    def convert(self, value: Any) -> list[Any]:
        items = [self.item.convert(v) for v in self._items(value)]
        return list(dict.fromkeys(items)) if self.unique else items


class Table(Check):
    """A mapping whose keys the group does not fix (a library's options); returned as a dict."""

    def describe(self) -> str:
        return "a mapping"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, Mapping)

    def convert(self, value: Any) -> dict[Any, Any]:
        return dict(value)


class OrNull(Check):
    """``null``, or a value of the kind ``inner``; ``means`` says what null stands for."""

    def __init__(self, inner: Check, means: str | None = None, **words: str) -> None:
        super().__init__(**words)
        self.inner, self.means = inner, means

    def describe(self) -> str:
        return f"null{f' ({self.means})' if self.means else ''} or {self.inner.what}"

    def accepts(self, value: Any) -> bool:
        return value is None or self.inner.accepts(value)

    def __call__(self, value: Any, key: str) -> Any:
        if value is None:
            return None
        if not self.inner.accepts(value):
            self.fail(value, key)
        return self.inner(value, key)


class AnyOf(Check):
    """A value of the first of ``options`` that accepts it."""

    def __init__(self, *options: Check, **words: str) -> None:
        super().__init__(**words)
        self.options = options

    def describe(self) -> str:
        return " or ".join(option.what for option in self.options)

    def accepts(self, value: Any) -> bool:
        return any(option.accepts(value) for option in self.options)

    def __call__(self, value: Any, key: str) -> Any:
        for option in self.options:
            if option.accepts(value):
                return option(value, key)
        self.fail(value, key)


class Group(Check):
    """A nested group: a mapping checked against the dataclass ``schema`` (null: its
    defaults); errors name the nested key (``search.cost.gpu``)."""

    def __init__(self, schema: type, **words: str) -> None:
        super().__init__(**words)
        self.schema = schema

    def describe(self) -> str:
        return f"a mapping of the keys {keys_of(self.schema)}"

    def accepts(self, value: Any) -> bool:
        return value is None or isinstance(value, Mapping)

    def __call__(self, value: Any, key: str) -> dict[str, Any]:
        if not self.accepts(value):
            self.fail(value, key)
        return check_group(self.schema, value, key)


# A seed of numpy (taken % 2**32) and of torch generators (seed + 1 must stay below 2**64):
# train.seed, train.init_seed and scene.seed.
SEED = Integer(0, 2**63 - 1, max_open=True, what="an integer in [0, 2**63 - 1)")
# What torch's Generator.manual_seed and tinycudann's size_t seed take without wrapping or
# overflowing (the modules' own seed arguments; a run's train.seed is SEED).
GENERATOR_SEED = Integer(0, 2**64, max_open=True, what="an integer in [0, 2**64)")


def check_seed(arg: str, value: Any, allow_none: bool = False) -> int | None:
    """``value`` as a Python int, or ``ValueError`` naming ``arg`` unless it is a
    :data:`GENERATOR_SEED` (or None where ``allow_none``: returned as None)."""
    if value is None and allow_none:
        return None
    if not GENERATOR_SEED.accepts(value):
        none = " or None" if allow_none else ""
        raise ValueError(f"{arg}: expected {GENERATOR_SEED.what}{none}, got {value!r}")
    return int(value)


# ----------------------------------------------------------------------------- schemas
Rule = Callable[[Mapping[str, Any]], "str | None"]


def setting(default: Any, check: Check | None = None, *, rule: Rule | None = None) -> Any:
    """A group's field: its default, the validator of its values (None: the annotation's),
    and ``rule``, a relation to the group's other keys: given the checked values, None when it
    holds, else what was expected (``"more than scene.near (0.1)"``).

    A list or dict default is copied for every instance (dataclasses refuse a shared one).
    """
    metadata = {"check": check, "rule": rule}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: _copy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return [_copy(v) for v in value] if isinstance(value, list) else value


def defaults_of(schema: type) -> dict[str, Any]:
    """Every key of the group ``schema`` with its default (nested groups as dicts; a value
    the user must give as :data:`REQUIRED`)."""
    return dataclasses.asdict(schema())


def keys_of(schema: type) -> list[str]:
    """The group's keys, sorted (as errors list them)."""
    return sorted(f.name for f in dataclasses.fields(schema))


def _annotation_check(annotation: Any) -> Check | None:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1 and len(args) == 2:
            check = _annotation_check(inner[0])
            return OrNull(check) if check is not None else None
        return None
    if origin is list and args:
        check = _annotation_check(args[0])
        return ListOf(check) if check is not None else None
    if origin is dict or annotation is dict:
        return Table()
    if dataclasses.is_dataclass(annotation):
        return Group(annotation)
    return {bool: Flag(), int: Integer(), float: Number(), str: Text()}.get(annotation)


@functools.cache
def _checks(schema: type) -> dict[str, tuple[Check | None, Rule | None, Any]]:
    """``{key: (validator, rule, default)}`` of a schema."""
    hints = typing.get_type_hints(schema)
    out = {}
    for f in dataclasses.fields(schema):
        check = f.metadata.get("check") or _annotation_check(hints[f.name])
        out[f.name] = (check, f.metadata.get("rule"), f.default)
    return out


def check_keys(schema: type, keys: Iterable[Any], prefix: str = "", *, context: str = "") -> None:
    """Refuse the first of ``keys`` that is no field of ``schema``: :class:`ConfigError`
    ``"<prefix>.<key>: unknown key; valid keys: [...]"`` (typos fail at start)."""
    fields = {f.name for f in dataclasses.fields(schema)}
    for key in keys:
        if key not in fields:
            name = f"{prefix}.{key}" if prefix else str(key)
            raise ConfigError(f"{name}: unknown key{context}; valid keys: {sorted(fields)}")


def check_fields(instance: Any, prefix: str = "") -> None:
    """Check each field of a dataclass instance with its validator (for a dataclass that checks
    itself in ``__post_init__``, such as :class:`~mptex.PrecisionPolicy`); errors name
    ``<prefix><field>``."""
    for key, (check, _, _) in _checks(type(instance)).items():
        if check is not None:
            check(getattr(instance, key), prefix + key)


def check_group(
    schema: type, values: Mapping[str, Any] | None, prefix: str, *, context: str = ""
) -> dict[str, Any]:
    """``values`` (a plain mapping; None: all defaults) checked against the group ``schema``.

    In this order: unknown keys, required values left unset, every value (its field's
    validator, in the schema's order), every relation (:func:`setting`'s ``rule``).

    Args:
        schema: the group's dataclass.
        values: the group as given; missing keys take the defaults.
        prefix: the group's key in the run config (``"train"``, ``"search.cost"``).
        context: words after ``unknown key`` / ``required`` (``" for scene 'mesh'"``).

    Returns:
        a plain dict with every key of the schema, values normalised by their validators.

    Raises:
        ConfigError: ``"<prefix>.<key>: ..."``, one line, for the first bad key.
    """
    given = dict(values or {})
    checks = _checks(schema)
    check_keys(schema, given, prefix, context=context)
    merged = {**defaults_of(schema), **given}
    for key, (_, _, default) in checks.items():
        value = merged[key]
        unset = isinstance(value, str) and value == REQUIRED
        if unset or (value is None and default == REQUIRED):
            raise ConfigError(f"{prefix}.{key}: required{context}, not set")
    for key, (check, _, _) in checks.items():
        if check is not None:
            merged[key] = check(merged[key], f"{prefix}.{key}")
    for key, (_, rule, _) in checks.items():
        expected = rule(merged) if rule is not None else None
        if expected is not None:
            raise ConfigError(f"{prefix}.{key}: expected {expected}, got {merged[key]!r}")
    return merged
