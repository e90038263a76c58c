"""Chat templates: Jinja that came with a checkpoint (or a --chat_template file), compiled once
and rendered in a sandbox that bounds the work as well as the access.

jinja2's ImmutableSandboxedEnvironment blocks escapes (no `__class__`, no mutating methods,
`range` at most 100,000 long) but not work: two nested `range(100000)` loops are 10^10
iterations at 100% CPU. So every rendering of one conversation is bounded:

- steps: every iteration of a `{% for %}` loop (the parsed template's loops iterate through a
  counter) and every call (macros, methods, `loop(...)` of a recursive loop, whose items count
  too), at most MAX_STEPS;
- size: the text written, at most MAX_CHARS characters; `*` may not build a longer string or
  list, nor `**` a number of more than MAX_POWER_DIGITS digits.

A template over a bound, stopped by the sandbox, that does not compile or that fails on a
conversation is a UsageError naming where it came from and the fix; records are rendered
before the model is built, so that is before any training.

Bounded by steps rather than time or tracing: docs/instruct.md. Not bounded beyond the step
count: a value that grows inside the template without being written (a string doubled in a loop).
"""

from __future__ import annotations

import datetime
import json
import math
import threading
from typing import Any

from jinja2 import TemplateSyntaxError, nodes, pass_context
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from nanochat.common import UsageError

MAX_STEPS = 100_000
"""Loop iterations plus calls per rendering: real templates take a few per message (the
built-in ones one, their loop over the messages), so this is thousands of messages' worth."""
MAX_CHARS = 10_000_000
"""Characters a rendering may write: about 2.5M tokens, beyond any model's context."""
MAX_POWER_DIGITS = 4300
"""Python's own limit for writing an int as text (sys.int_info.default_max_str_digits)."""

ANOTHER = "choose another with --chat_template plain|chatml|llama3|<file.jinja>"
FIX = f"fix the template, or {ANOTHER}"


class _OverBound(Exception):
    """A rendering went over one of the bounds (the message says which)."""


class _Refused(Exception):
    """The template called raise_exception(message): it refuses the conversation."""


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment that counts loop iterations and calls (per thread, from
    `start`) and checks the size of `*` and `**` before computing them."""

    intercepted_binops = frozenset({"*", "**"})  # intercepted ones are also never constant-folded

    def __init__(self) -> None:
        # trim_blocks/lstrip_blocks: the whitespace rules chat templates are written for
        super().__init__(trim_blocks=True, lstrip_blocks=True)
        self._steps = threading.local()
        # pass_context: a filter that takes the context is never run at compile time
        self.filters["_counted"] = pass_context(lambda context, items: self._counted(items))

    def parse_counted(self, source: str) -> nodes.Template:
        """The template's syntax tree with every `for` loop iterating through `_counted`."""
        tree = self.parse(source)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, "_counted", [], [], None, None, lineno=loop.lineno)
        return tree

    def start(self) -> None:
        self._steps.n = 0

    def _step(self) -> None:
        self._steps.n += 1
        if self._steps.n > MAX_STEPS:
            raise _OverBound(f"took more than {MAX_STEPS:,} loop iterations and calls")

    def _counted(self, items):
        for item in items:
            self._step()
            yield item

    def call(self, context, obj, /, *args: Any, **kwargs: Any) -> Any:
        self._step()
        if isinstance(obj, LoopContext) and args:  # loop(children) in a recursive loop
            args = (self._counted(args[0]), *args[1:])
        return super().call(context, obj, *args, **kwargs)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_CHARS:
                raise _OverBound(f"repeated a value of length {len(seq):,} {n:,} times (more than "
                                 f"{MAX_CHARS:,} characters)")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            if right > 0 and right * math.log10(abs(left)) > MAX_POWER_DIGITS:
                raise _OverBound(f"computed {left} ** {right} (more than {MAX_POWER_DIGITS:,} digits)")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: str):
    raise _Refused(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


class ChatTemplate:
    """A template's source compiled once (compiling costs far more than rendering, and
    instruction data renders every record several times, prefix by prefix)."""

    def __init__(self, source: str, origin: str) -> None:
        self.origin = origin
        """Where the source came from, for messages: a file, or the flag that chose it."""
        self._env = _BoundedSandbox()
        # the helpers transformers' apply_chat_template gives templates
        self._env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        self._env.filters["tojson"] = _tojson
        try:
            self._template = self._env.from_string(self._env.parse_counted(source))
        except TemplateSyntaxError as e:
            raise UsageError(f"chat template {origin} does not compile: {e.message} (line {e.lineno}); {FIX}") from None

    def render(self, **variables: Any) -> str:
        """The text of the template with `variables` (messages, add_generation_prompt, ...),
        within the bounds; a UsageError otherwise (see the module docstring)."""
        self._env.start()
        out, size = [], 0
        try:
            for chunk in self._template.generate(**variables):
                size += len(chunk)
                if size > MAX_CHARS:
                    raise _OverBound(f"wrote more than {MAX_CHARS:,} characters")
                out.append(chunk)
        except _OverBound as e:
            raise UsageError(f"chat template {self.origin} went over its bound rendering one conversation: "
                             f"it {e}; {FIX}") from None
        except _Refused as e:
            raise UsageError(f"chat template {self.origin} refuses this conversation: {e}; change the record "
                             f"to the template's rules, or {ANOTHER}") from None
        except SecurityError as e:
            raise UsageError(f"chat template {self.origin} was stopped by the sandbox: {e} (a chat "
                             f"template may only format the messages); {FIX}") from None
        except Exception as e:  # noqa: BLE001 - the template's own code failed, whatever the error
            raise UsageError(f"chat template {self.origin} failed on this conversation: "
                             f"{type(e).__name__}: {e}; {FIX}") from None
        return "".join(out)
