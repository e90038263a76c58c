"""The resume policy: what a checkpoint must share with the run that continues it (--resume), and
what a new run may start from (--init_from). Each rule is checked here, once, before the model
is built, and a mismatch is one UsageError naming the flag and the fix.

--resume continues a run as if it had never stopped, so what changes the model, the data stream
or the optimizer's meaning must be as the checkpoint has it: the flags config marks as kept
(`RESUME_MUST_MATCH`), compared as resolved paths where they are paths (`tok/` and its absolute
form name one directory); the
global batch (batch_size x ranks, so 2 ranks of 8 resume in 1 process of 16); and the tokenizer
(its fingerprint). Everything else (--num_iterations, --eval_every, ...) may differ, so a run can
be extended, but not to nothing: a checkpoint at or past the last step is refused. Those that
differ are said, one warning line each (`changed_settings`): a changed --lr, or a --num_iterations
that recomputes the schedule over a new total, changes the rate at the very next step.
`setting_differences` is the comparison itself; FP8Trainer uses it for the FP8 settings of a
Hugging Face Trainer checkpoint. --auto_resume applies the same rules to the checkpoint it
finds, and before a run's first checkpoint to the settings its start records hold (`identity`).

--init_from starts a new run (step 0, a fresh optimizer) from another run's newest checkpoint: a
nanochat preset of the same name, read with the tokenizer it was trained with (checked by
fingerprint before any weight is read). A Hugging Face model continues from its export instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from nanochat.checkpoint.storage import Checkpoint
from nanochat.common import UsageError, dist_env, logger
from nanochat.config import RESUME_MUST_MATCH, TrainConfig
from nanochat.model.gpt import PRESETS
from nanochat.optim.schedule import lr_multiplier
from nanochat.tokenizer import Tokenizer, run_tokenizer

RESUME_KEYS = ("config.batch_size", "step", "data", "tokenizer_fingerprint")
"""What a checkpoint must hold to be resumed (dotted: nested), besides the tensors: a .pt's
"model", "optimizer" and "rng" (TENSORS), which a DCP step holds outside its trainer.json."""
INIT_KEYS = ("config.model_name", "step", "tokenizer_fingerprint")
"""What a checkpoint must hold to start another run from (--init_from), besides "model"."""
TENSORS = ("model", "optimizer", "rng")
PATH_FIELDS = ("model_name", "dataset_path", "tokenizer_dir", "init_from")
HOW_STARTED = ("resume", "auto_resume", "overwrite", "run_dir", "batch_size")
"""Flags that say how this start continues the run, not what it trains: never reported as changed
(--batch_size is checked as the global batch, which must match)."""
SCHEDULE = ("lr", "num_iterations", "num_epochs", "warmup_steps", "final_lr_frac")
"""The flags the learning rate at a step depends on (nanochat.optim.schedule)."""


def resolved_paths(config: TrainConfig) -> dict[str, str | None]:
    """The path-valued fields as absolute, symlink-free paths: what resume compares (so `tok/`
    and `tok`, relative and absolute, name the same directory). Saved with every checkpoint."""
    out = {}
    for k in PATH_FIELDS:
        v = getattr(config, k)
        out[k] = None if v is None else (os.path.realpath(v) if os.path.exists(v) else v)
    return out


def setting_differences(saved: Mapping[str, Any], now: Mapping[str, Any],
                        keys: Iterable[str]) -> dict[str, tuple[Any, Any]]:
    """{key: (the checkpoint's value, this run's)} for each of `keys` on which they differ."""
    return {k: (saved.get(k), now.get(k)) for k in keys if saved.get(k) != now.get(k)}


def check_budget(c: Checkpoint, config: TrainConfig, total_steps: int, flag: str = "--resume") -> None:
    """A resume from `c` must leave steps to train: refused at or past the last step (one whose
    run died before its result.json does resume, to finish). --auto_resume (`flag`) is not
    refused a run that finished there: the trainer reports it (Checkpointer.finished)."""
    more = f"pass a larger --num_iterations (more than {c.step}) to train on"
    if c.step > total_steps:
        budget = (f"--num_iterations {config.num_iterations}" if config.num_iterations > 0
                  else f"--num_epochs {config.num_epochs} ({total_steps} steps)")
        raise UsageError(f"{flag}: {c.run_dir} is already at step {c.step} ({c.path.name}); {budget} would train "
                         f"nothing: {more}")
    if flag == "--resume" and c.step == total_steps and finished_steps(c.run_dir) == c.step:
        raise UsageError(f"--resume: the run in {c.run_dir} already finished at step {c.step} (its result.json); "
                         f"{more}, or start it over with --overwrite")


def finished_steps(run_dir: str | os.PathLike) -> int | None:
    """The steps the run's result.json says it finished with; None without one."""
    try:
        steps = json.loads((Path(run_dir) / "result.json").read_text()).get("steps")
    except (OSError, ValueError, AttributeError):
        return None
    return steps if isinstance(steps, int) else None


def identity(config: TrainConfig) -> dict[str, Any]:
    """What identifies a run before it has a checkpoint: its kept settings (`RESUME_MUST_MATCH`)
    and resolved paths, as a checkpoint holds them. Every start record carries it."""
    now = config.to_dict()
    return {"settings": {k: now[k] for k in RESUME_MUST_MATCH}, "resolved_paths": resolved_paths(config)}


def kept_differences(saved: Mapping[str, Any], saved_paths: Mapping[str, Any],
                     config: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """{flag: (saved, now)} for each kept flag on which `saved` (a checkpoint's config, or a start
    record's settings) differs from `config`; paths compare resolved (`saved_paths`)."""
    paths_now = resolved_paths(config)
    # a kept flag added after the checkpoint was written: it ran at that flag's default
    # (AdamW was the only optimizer before --optimizer)
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)
                if f.name not in saved and f.default is not dataclasses.MISSING}
    if defaults.get("optimizer") == "auto":
        defaults["optimizer"] = "adamw"
    diff = setting_differences({**defaults, **saved}, config.to_dict(), RESUME_MUST_MATCH)
    for k in PATH_FIELDS:
        if k in diff and saved_paths.get(k, saved.get(k)) == paths_now[k]:
            del diff[k]
    return diff


def _listed(diff: Mapping[str, tuple[Any, Any]], saved_name: str) -> str:
    return ", ".join(f"--{k}: {saved_name} {a!r} vs now {b!r}" for k, (a, b) in diff.items())


def check_resume(meta: dict[str, Any], config: TrainConfig, *, world_size: int, tokenizer: Any,
                 flag: str = "--resume") -> None:
    """Whether the checkpoint `meta` (its config, data-parallel size and tokenizer fingerprint) can
    continue this run at `world_size` data-parallel ranks (module docstring); a UsageError listing every difference otherwise
    (for --auto_resume, `flag`: the directory holds a different run)."""
    saved, now = meta["config"], config.to_dict()
    diff = kept_differences(saved, meta.get("resolved_paths") or {}, config)
    saved_ranks = meta.get("data_parallel", meta.get("world_size", 1))  # a TP group shares one batch
    if saved["batch_size"] * saved_ranks != now["batch_size"] * world_size:
        diff["batch_size"] = (f"{saved['batch_size']} x {saved_ranks} ranks", f"{now['batch_size']} x {world_size} ranks")
    other = f"{flag}: {config.run_dir} holds a different run" if flag == "--auto_resume" else None
    if diff:
        if other:
            raise UsageError(f"{other}: its checkpoint's settings differ from this run's ({_listed(diff, 'checkpoint')});"
                             " use its values to continue it, or a new --run_dir for this run (nothing was changed)")
        level = (". FP8Optim loads moments saved at another --fp8_opt_level, but a resumed run keeps its "
                 "checkpoint's level (its optimizer state continues as saved); to change the level, start a "
                 "new run from these weights with --init_from" if "fp8_opt_level" in diff else "")
        raise UsageError(f"--resume: this run's settings differ from the checkpoint's ({_listed(diff, 'checkpoint')}); "
                         f"use the checkpoint's values or a new --run_dir{level}")
    if meta["tokenizer_fingerprint"] != tokenizer.fingerprint:
        raise UsageError(f"{other or flag}: the tokenizer differs from the one the checkpoint was trained "
                         "with; pass the same --tokenizer_dir (or the same corpus and --vocab_size)")


def changed_settings(meta: dict[str, Any], config: TrainConfig, total_steps: int) -> list[str]:
    """One line per flag that may differ from the checkpoint `meta` and does (what, from, to);
    a schedule flag's line adds the learning rate at the resumed step under the saved settings
    and under this run's."""
    saved, now, step = meta["config"], config.to_dict(), meta["step"]
    keys = [k for k in now if k not in RESUME_MUST_MATCH and k not in HOW_STARTED and k in saved]
    diff = setting_differences(saved, now, keys)
    if not diff:
        return []
    rates = ""
    if any(k in SCHEDULE for k in diff):
        saved_total = _saved_total(saved, config, total_steps)
        before = (None if saved_total is None else
                  saved["lr"] * lr_multiplier(step, saved_total, saved["warmup_steps"], saved["final_lr_frac"]))
        after = config.lr * lr_multiplier(step, total_steps, config.warmup_steps, config.final_lr_frac)
        rates = (f"; the learning rate at step {step + 1} is {after:.3g}"
                 + (f", {before:.3g} under the checkpoint's settings" if before is not None else ""))
    return [f"resumed with --{k} changed from the checkpoint's {a!r} to {b!r}{rates if k in SCHEDULE else ''}"
            for k, (a, b) in diff.items()]


def _saved_total(saved: Mapping[str, Any], config: TrainConfig, total_steps: int) -> int | None:
    """The steps the checkpoint's run planned; None where its --num_epochs cannot be counted here
    (this run gives --num_iterations: its steps per epoch are unknown)."""
    if saved.get("num_iterations", 0) > 0:
        return saved["num_iterations"]
    if config.num_iterations <= 0 and config.num_epochs:
        return saved["num_epochs"] * total_steps // config.num_epochs
    return None


def warn_changed_settings(meta: dict[str, Any], config: TrainConfig, total_steps: int) -> None:
    """`changed_settings` as warnings, by rank 0 (every rank reads the same checkpoint)."""
    if dist_env().rank == 0:
        for line in changed_settings(meta, config, total_steps):
            logger.warning(line)


def check_recorded_run(starts: list[dict[str, Any]], config: TrainConfig) -> None:
    """--auto_resume over a run's records without a checkpoint (it died before its first): they
    must be this run's, as their first start record's `identity` says; a UsageError otherwise,
    since starting over would replace another run's records."""
    d = config.run_dir
    first = starts[0] if starts else None
    if first is None or not isinstance(first.get("settings"), dict):
        raise UsageError(f"--auto_resume: {d} holds a run's records (metrics.jsonl or result.json) but no checkpoint, "
                         "and no start record that says which run wrote them; continue it with --resume if it is "
                         "this run's, replace it with --overwrite, or choose a new --run_dir")
    diff = kept_differences(first["settings"], first.get("resolved_paths") or {}, config)
    if diff:
        raise UsageError(f"--auto_resume: {d} holds a different run, which saved no checkpoint: its settings differ "
                         f"from this run's ({_listed(diff, 'recorded')}); use its values to start it over, or a new "
                         "--run_dir for this run (nothing was changed)")


def check_init_source(meta: dict[str, Any], config: TrainConfig, src: Path) -> Tokenizer:
    """Whether the checkpoint `meta` of run directory `src` can start this run (--init_from): a
    preset of the same name and the tokenizer it trained with, which is returned."""
    name = meta["config"]["model_name"]
    if name not in PRESETS:
        raise UsageError(f"--init_from {src} trained the Hugging Face model {name}: continue from its export "
                         f"(python scripts/export_hf.py --run_dir {src} --out_dir <dir>, then --model_name <dir>)")
    if name != config.model_name:
        raise UsageError(f"--init_from {src} holds a {name} model, --model_name is {config.model_name}: "
                         f"pass --model_name {name}")
    tokenizer = run_tokenizer(src, meta["tokenizer_fingerprint"], "--init_from")
    return tokenizer


__all__ = ["RESUME_KEYS", "INIT_KEYS", "TENSORS", "resolved_paths", "setting_differences", "check_budget",
           "finished_steps", "identity", "kept_differences", "check_resume", "changed_settings",
           "warn_changed_settings", "check_recorded_run", "check_init_source"]
