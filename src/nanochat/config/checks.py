"""The checks every config runs at construction, from the command line or from Python alike.

`Checked` is the root of every config class: its `__post_init__` turns what a Python caller may
pass in a friendlier form (a pathlib.Path, a list) into what the field holds (str, tuple: configs
stay JSON-able and hashable), then checks each value against its annotation. The field groups
and configs chain their own range checks after it through `super().__post_init__()`, with the
helpers below, so every message names the flag (`--lr must be a finite number, got nan`).

Why a type check of our own: tyro checks types only while parsing a command line, and
`TrainConfig(batch_size=2.5)` or `NanoChatTrainer(fp8="yes")` never passes through tyro; tyro has
no public function that checks a value against an annotation. The configs use a small subset of
typing (Literal, unions with None, homogeneous tuples, plain classes), which `matches` covers in
a few lines, without a type-checking dependency (docs/design.md). `describe` words a type as the
messages do ("an int", "one of 'e4m3', 'e5m2'"), and the command line's errors reuse it
(nanochat.config.cli).
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from typing import Annotated, Literal

RESUME = {"resume": "must match"}
"""Field metadata of a flag a --resume must share with its checkpoint (see `kept`)."""


def kept(default):
    """A field a --resume must share with its checkpoint: it changes the model, the data stream or
    the optimizer's meaning (nanochat.config.RESUME_MUST_MATCH)."""
    return dataclasses.field(default=default, metadata=RESUME)


class Checked:
    """The root of every config's checks: `__post_init__` runs the groups' checks through
    `super()`, and here, first, turns pathlib.Path values (API callers) into the str the field
    holds and lists into tuples (configs stay JSON and hashable), then checks every type."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, os.PathLike):
                object.__setattr__(self, f.name, os.fspath(value))
            elif isinstance(value, list):
                object.__setattr__(self, f.name, tuple(value))
        check_types(self)


def matches(value, hint) -> bool:
    """Whether `value` has the annotated type (the subset of typing these configs use)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return matches(value, args[0])
    if origin is Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if origin in (typing.Union, types.UnionType):
        return any(matches(value, a) for a in args)
    if origin is tuple:
        return isinstance(value, tuple) and all(matches(v, args[0]) for v in value)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def describe(hint) -> str:
    """A type as the error messages word it: "an int", "one of 'e4m3', 'e5m2'", "a str or None"."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return describe(args[0])
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if origin is tuple:
        return f"a tuple, each {describe(args[0])}"
    if hint is type(None):
        return "None"
    return f"{'an' if hint.__name__[0] in 'aeiou' else 'a'} {hint.__name__}"


def check_types(cfg) -> None:
    """The CLI checks types itself; this catches the Python API's mistakes (batch_size=2.5,
    fp8="yes") at construction instead of deep inside training."""
    hints = typing.get_type_hints(type(cfg), include_extras=True)
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if not matches(value, hints[f.name]):
            raise ValueError(f"--{f.name} must be {describe(hints[f.name])}, got {value!r} "
                             f"({type(value).__name__})")


def finite(cfg, *names: str) -> None:
    for n in names:
        if getattr(cfg, n) is not None and not math.isfinite(getattr(cfg, n)):
            raise ValueError(f"--{n} must be a finite number, got {getattr(cfg, n)}")


def check_vocab_size(cfg) -> None:
    if cfg.vocab_size < 260:
        raise ValueError(f"--vocab_size must be >= 260 (256 bytes + special tokens), got {cfg.vocab_size}")


def positive(cfg, *names: str) -> None:
    for n in names:
        if getattr(cfg, n) <= 0:
            raise ValueError(f"--{n} must be positive, got {getattr(cfg, n)}")


def non_negative(cfg, *names: str) -> None:
    for n in names:
        if getattr(cfg, n) is not None and getattr(cfg, n) < 0:
            raise ValueError(f"--{n} must be >= 0, got {getattr(cfg, n)}")
