"""nanochat.tokenizer.chat_template: chat templates rendered in a sandbox that bounds work and size.

- The same text as jinja2's own ImmutableSandboxedEnvironment (same whitespace options) for the
  built-in templates and for one using the constructs real templates use (a loop filter,
  loop.index/length/first/last, for-else, a recursive loop, macros, a namespace, dict items,
  filters): exact, the same engine with counters added.
- The step bound is exact: the built-in templates take one step per message, so a conversation
  of MAX_STEPS messages renders and one more message is over the bound.
- Runaway templates end in a UsageError naming the template and the bound it went over: nested
  range(100000) loops (10^10 iterations), the same over a list, a recursive loop recursing into
  range(100000), a macro calling itself twice per level 60 levels deep (2^60 calls), 2e7
  characters written, 'x' * 10**9, 10 ** 100000. That these tests finish is the point.
- An escape attempt (the sandbox's SecurityError), a syntax error, raise_exception(...) and a
  TypeError in the template are one-line UsageErrors naming the template and the fix.
- The CLI: base_train.py on a base Llama whose chat_template.jinja loops 10^10 times, or tries an
  escape, exits 2 with one `error:` line naming the records file, the template file and the fix,
  no traceback, and no step taken.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nanochat.data import instruct
from nanochat.tokenizer.chat_template import MAX_CHARS, MAX_STEPS, ChatTemplate
from nanochat.common import UsageError

ROOT = Path(__file__).resolve().parents[1]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " 2+2? "},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "6"}]
RICH = (
    "{%- set ns = namespace(chars=0) -%}"
    "{%- macro turn(m) -%}<{{ m.role | upper }}>{{ m.content | trim }}</{{ m.role }}>{%- endmacro -%}"
    "{%- for m in messages if m.role != 'system' -%}"
    "{{ loop.index }}/{{ loop.length }}{{ '^' if loop.first }}{{ '$' if loop.last }}{{ turn(m) }}"
    "{%- set ns.chars = ns.chars + m.content | length -%}"
    "{%- else -%}no turns"
    "{%- endfor -%}\n"
    "{% for key, value in {'a': 1, 'b': 2}.items() %}{{ key }}={{ value }};{% endfor %}\n"
    "{% for node in tree recursive %}[{{ node.name }}{{ loop(node.children) if node.children }}]{% endfor %}\n"
    "{{ ns.chars }} {{ messages | map(attribute='role') | join(',') }} {{ messages[-1].content.strip() if messages }}"
    "{% if add_generation_prompt %}<ASSISTANT>{% endif %}"
)
TREE = [{"name": "a", "children": [{"name": "b", "children": [{"name": "c", "children": []}]}]}, {"name": "d"}]


def _reference(source: str, **variables) -> str:
    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source).render(**variables)


@pytest.mark.parametrize("source", [RICH, *instruct.BUILTIN_TEMPLATES.values()],
                         ids=["rich", *instruct.BUILTIN_TEMPLATES])
def test_renders_what_jinja_renders(source):
    for messages in (MESSAGES, MESSAGES[:1], [], MESSAGES[1:3]):
        for generation in (False, True):
            variables = dict(messages=messages, tree=TREE, add_generation_prompt=generation, bos_token="<s>",
                             eos_token="</s>")
            assert ChatTemplate(source, "t.jinja").render(**variables) == _reference(source, **variables)


def test_step_bound_is_exact_on_a_builtin_template():
    template = ChatTemplate(instruct.CHATML_TEMPLATE, "'chatml' (built in)")
    messages = [{"role": "user", "content": "hi"}] * MAX_STEPS
    assert template.render(messages=messages).count("<|im_start|>") == MAX_STEPS
    with pytest.raises(UsageError, match=f"took more than {MAX_STEPS:,} loop iterations and calls"):
        template.render(messages=messages + messages[:1])
    assert template.render(messages=messages[:2]).count("<|im_start|>") == 2  # the count restarts


@pytest.mark.parametrize("source, bound", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "took more than 100,000 loop iterations and calls"),
    ("{% set r = range(100000) | list %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",
     "took more than 100,000 loop iterations and calls"),
    ("{% for i in [1, 2] recursive %}{% if loop.depth < 3 %}{{ loop(range(100000)) }}{% endif %}{% endfor %}",
     "took more than 100,000 loop iterations and calls"),
    ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
     "took more than 100,000 loop iterations and calls"),
    ("{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}", f"wrote more than {MAX_CHARS:,} characters"),
    ("{{ 'x' * 1000000000 }}", "repeated a value of length 1 1,000,000,000 times"),
    ("{{ 10 ** 100000 }}", r"computed 10 \*\* 100000 \(more than 4,300 digits\)"),
], ids=["nested-range", "nested-list", "recursive-loop", "macro-recursion", "output", "repeat", "power"])
def test_runaway_templates_stop_at_a_bound(source, bound):
    with pytest.raises(UsageError, match=f"^chat template my.jinja went over its bound rendering one "
                                         f"conversation: it {bound}.*; fix the template, or choose another "
                                         r"with --chat_template plain\|chatml\|llama3\|<file.jinja>$"):
        ChatTemplate(source, "my.jinja").render(messages=[{"role": "user", "content": "y" * 200}])


@pytest.mark.parametrize("source, message", [
    ("{{ messages.__class__.__mro__ }}", "was stopped by the sandbox: access to attribute '__class__' of 'list' "
                                         "object is unsafe"),
    ("{% for %}", r"does not compile: Expected an expression, got 'end of statement block' \(line 1\)"),
    ("{{ raise_exception('Conversation roles must alternate') }}",
     "refuses this conversation: Conversation roles must alternate; change the record"),
    ("{{ messages[0].content + 1 }}", "failed on this conversation: TypeError: "),
], ids=["escape", "syntax", "raise_exception", "type-error"])
def test_template_errors_are_one_line_naming_the_template(source, message):
    with pytest.raises(UsageError, match=f"^chat template /models/x/chat_template.jinja {message}") as e:
        ChatTemplate(source, "/models/x/chat_template.jinja").render(messages=[{"role": "user", "content": "y"}])
    assert "\n" not in str(e.value) and "--chat_template" in str(e.value)


@pytest.fixture(scope="module")
def base_llama_and_arc(tmp_path_factory):
    """A base Llama directory (no chat template) and ARC parquet, as in tests/test_eval.py."""
    pytest.importorskip("transformers")
    pytest.importorskip("pyarrow")
    from tests.test_eval import write_arc, write_base_llama

    root = tmp_path_factory.mktemp("cli")
    return write_base_llama(root / "base"), write_arc(root / "arc")


@pytest.mark.parametrize("source, says", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "went over its bound rendering one conversation: it took more than 100,000 loop iterations and calls"),
    ("{{ messages.__class__.__mro__ }}", "was stopped by the sandbox"),
], ids=["hang", "escape"])
def test_cli_refuses_the_template_in_one_line_before_training(base_llama_and_arc, tmp_path, source, says):
    base, arc = base_llama_and_arc
    model = tmp_path / "model"
    shutil.copytree(base, model)
    (model / "chat_template.jinja").write_text(source)
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "base_train.py"), "--model_name", str(model),
                        "--dataset_path", str(arc), "--num_iterations", "2", "--batch_size", "2", "--seq_len", "64",
                        "--device", "cpu", "--run_dir", str(run)],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "train-00000-of-00001.parquet" in errors[0] and f"chat template {model}/chat_template.jinja {says}" \
        in errors[0] and errors[0].endswith("--chat_template plain|chatml|llama3|<file.jinja>")
    assert not list(run.glob("checkpoint*")) and "step 0" not in r.stdout
