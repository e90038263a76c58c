"""parse_cli: a config dataclass from the command line, every rejection as one `error:` line.

tyro builds the CLI from the dataclass (flags, types, `--help` from the field docstrings); this
module changes only how a bad command line ends. tyro draws its errors in a box of several lines
and would draw a `__post_init__` ValueError the same way; a user of a training script (and a
scheduler's log) gets one line instead, naming the flag and the fix, with exit status 2:

    error: --fp8_mode: 'e3m4' is not one of e4m3, e5m2, auto; give one of those (... --help says what each does)

So tyro parses a copy of the class without its checks (`_unchecked`), and parse_cli constructs
the real class itself, printing its ValueError as written. tyro's own parse errors are reworded
through its parse-error hook, `tyro._errors.on_parse_error`: tyro offers no public way to learn
which flag failed and why (`tyro.cli(console_outputs=False)` only silences the box), so this one
experimental hook is used, guarded: a tyro without it, or an event this module does not know,
keeps tyro's own message and exit status 2. Flags are shown with underscores (`--fp8_mode`);
tyro also accepts the hyphenated spelling (`--fp8-mode`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import sys
import types
import typing
from typing import TypeVar

import tyro

from nanochat.config.checks import describe

C = TypeVar("C")


def parse_cli(cls: type[C], args: list[str] | None = None) -> C:
    """Parse argv into `cls`. Every rejection is one `error: ...` line on stderr and exit status
    2: tyro's own (an unknown flag, a value that is not a choice or not a number, a missing value)
    and `cls.__post_init__`'s checks, which run here, after tyro, so their message is printed as
    written (tyro would draw it in a box). `--help` is tyro's, unchanged."""
    try:
        with _one_line_parse_errors(cls):
            parsed = tyro.cli(_unchecked(cls), args=args, use_underscores=True)
        return cls(**{f.name: getattr(parsed, f.name) for f in dataclasses.fields(cls) if f.init})
    except (ValueError, _Rejected) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


@functools.cache
def _unchecked(cls: type) -> type:
    """`cls` without its `__post_init__`: the fields, defaults and help tyro reads, and no checks,
    so tyro never sees (and boxes) a ValueError; parse_cli constructs `cls` itself."""
    namespace = {"__post_init__": lambda self: None, "__doc__": cls.__doc__, "__module__": cls.__module__}
    return dataclasses.make_dataclass(cls.__name__, [], bases=(cls,), namespace=namespace,
                                      frozen=True, kw_only=True)


class _Rejected(Exception):
    """A parse error of tyro's, reworded as parse_cli's one line."""


def _one_line_parse_errors(cls: type) -> contextlib.AbstractContextManager:
    """While tyro parses: its errors for a bad command line raise `_Rejected` with one line naming
    the flag and the fix instead of printing a box. This uses tyro's parse-error hook
    (`tyro._errors`, marked experimental by tyro); a tyro without it, or a kind of error not
    handled here, keeps tyro's own message (still exit status 2)."""
    try:
        from tyro import _errors
    except ImportError:
        return contextlib.nullcontext()
    hints = typing.get_type_hints(cls, include_extras=True)

    def flag(argument) -> tuple[str, str]:
        """(--flag, what it takes) of one of tyro's argument definitions."""
        lowered = getattr(argument, "lowered", None)
        names = getattr(lowered, "name_or_flags", None) or ("an argument",)
        name = next((n for n in names if n.startswith("--")), names[0])
        hint = hints.get(getattr(lowered, "dest", None) or name.lstrip("-"))
        if not name.startswith("-"):  # a positional argument: named as --help shows it (RUN_DIR)
            name = getattr(lowered, "metavar", None) or name
        if typing.get_origin(hint) in (typing.Union, types.UnionType):  # `str | None`: "None" is the default
            hint = typing.Union[tuple(a for a in typing.get_args(hint) if a is not type(None))]
        return name, describe(hint) if hint is not None else "a value"

    def hook(event) -> None:
        help_hint = f"{event.prog} --help lists the flags"
        if isinstance(event, _errors.InvalidChoice):
            name, _ = flag(event.argument)
            raise _Rejected(f"{name}: {event.value!r} is not one of {', '.join(event.choices)}; "
                            f"give one of those ({event.prog} --help says what each does)")
        if isinstance(event, _errors.BadValue):
            name, takes = flag(event.argument)
            if event.reason == "too_few_values":
                raise _Rejected(f"{name} is missing its value; give {takes} after it")
            raise _Rejected(f"{name} takes no value here (got {event.offending_value!r}); {help_hint}")
        if isinstance(event, _errors.InstantiationFailure) and event.argument is not None:
            name, takes = flag(event.argument)
            raise _Rejected(f"{name}: {event.message}; it takes {takes}")
        if isinstance(event, _errors.MissingArgs):
            missing = [flag(a.arg) for a in event.missing_arguments]
            raise _Rejected(f"{', '.join(n for n, _ in missing)} is required (it has no default): give "
                            + ", ".join(f"{n} followed by {takes}" if n.startswith("-") else f"{n}, {takes}"
                                        for n, takes in missing))
        if isinstance(event, _errors.UnrecognizedArgs):
            unknown = [t for t in event.tokens if t.startswith("-")]
            if not unknown:
                raise _Rejected(f"unexpected argument {' '.join(event.tokens)}: every value follows its --flag, "
                                f"and on/off flags take none; {help_hint}")
            typed = unknown[0].split("=")[0].lstrip("-").replace("-", "_")
            near = difflib.get_close_matches(typed, [f.name for f in dataclasses.fields(cls)], n=1)
            raise _Rejected(f"unknown flag {' '.join(unknown)}"
                            + (f" (did you mean --{near[0]}?)" if near else "") + f"; {help_hint}")

    return _errors.on_parse_error(hook)
