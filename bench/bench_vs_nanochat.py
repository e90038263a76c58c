"""karpathy/nanochat against ours, trained side by side on the same text: val bpb at every
evaluation, tokens/s, wall time, and the steps and time each needs to reach the other's final bpb.

    .venv/bin/python bench/bench_vs_nanochat.py --nanochat_dir /path/to/nanochat      # d2, 300 steps
    .venv/bin/python bench/bench_vs_nanochat.py --nanochat_dir D --optimizer muon adamw --out f.json
    .venv/bin/python bench/bench_vs_nanochat.py --nanochat_dir D --quick             # a dry run, ~1 min
    .venv/bin/python bench/bench_vs_nanochat.py --merge a.json b.json --out f.json   # parts as one run

nanochat runs as a subprocess from the checkout --nanochat_dir (its commit is recorded) with
--nanochat_python (default: this Python), which needs torch, pyarrow, rustbpe, tiktoken, wandb,
psutil and filelock (checked before any work; our .venv with the dev extras has them,
and the checkout's `nanochat` package wins over ours there). Otherwise give it a venv of its own
(`uv sync --extra cpu` in the checkout, or `python -m venv V && V/bin/pip install <those>`) and
pass its python.

Protocol.
1. One corpus, split once (`split_corpus`): the documents of --dataset_path (default: this
   Python's standard library), on the sides our rule puts them (split files' roles, else
   sha1(id) < nanochat.data.split.VAL_FRACTION), each cut after a newline into pieces of at most
   --doc_chars characters: nanochat's rows start at a document's start and drop what does not
   fit, so whole source files would train it on their first --seq_len tokens only.
2. `write_corpus` writes them as nanochat's parquet shards, the validation split last (its
   layout) in <work_dir>/nanochat_base/base_data_climbmix/; ours reads the same files through
   links named train-*.parquet / validation-00000.parquet.
3. Each project trains its own BPE tokenizer (--vocab_size, the first --tokenizer_chars of the
   train shards); ours builds its token store; nanochat tokenizes in its loop. Timed apart.
4. The same model: depth --depth, width 64 x depth, one head per 128 channels (ours: the
   d<depth> preset; nanochat: --aspect-ratio 64 --head-dim 128 --window-pattern L); --batch_size
   x --seq_len tokens a step, no accumulation; --num_iterations steps; an evaluation and a
   checkpoint every --eval_every steps. Everything else is each project's default (nanochat's
   Muon + AdamW at rates scaled to the batch, its warmup, warmdown and value embeddings; ours
   with --optimizer, --lr, --muon_lr, --packing, --fp8_opt_level, --ours_args; --nanochat_args).
5. bpb on one protocol: after each run, its checkpoints are scored by bench/common_bpb.py (every
   token of every validation document, rows starting at a document's start; its docstring says
   why each project's own evaluator cannot compare the two), ours in this process, nanochat's
   by bench/score_nanochat.py in its Python. Each project's own figure is kept (own_*).
6. Runs alternate (nanochat, ours, ... over --seeds), each a fresh process that --timeout_s ends
   with its process group. nanochat seeds itself (42): its repeats differ in time only. Both
   compile unless --no_compile (nanochat's through TORCHDYNAMO_DISABLE=1).

Figures: the common evaluator's curves; tokens/s from nanochat's step lines after its first 10
steps (as its own total time counts) and from our result.json (steps that did not compile);
wall time: the training process's, start to exit, checkpoint writes included (both write one at
each evaluation), scoring not. The steps to the other's final bpb, and to nanochat's best
evaluation (its curve can rise before the end: a small corpus trained for many epochs), are
`harness.steps_to` on the curve (a target the run is past at its first evaluation is marked as an
upper bound: measure it with a smaller --eval_every); the time is those steps at the run's tokens/s
(bench/vs_nanochat_report.py, which also joins parts of a long sweep run apart: --nanochat_runs 0
and --merge).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import harness
import vs_nanochat_report
from nanochat.common import NanoChatError

ROOT = Path(__file__).resolve().parents[1]
NANOCHAT_MODULES = ("torch", "pyarrow", "rustbpe", "tiktoken", "wandb", "psutil", "filelock")
"""What nanochat's base_train and tok_train import (its pyproject's dependencies, numpy aside).
`kernels` is not among them: nanochat tries it for Flash Attention 3 on a CUDA GPU (it downloads
the kernel from the Hugging Face hub) and otherwise attends with PyTorch's SDPA; each run records
which (`attention`)."""


@dataclass(frozen=True, kw_only=True)
class BenchVsNanochatConfig:
    """karpathy/nanochat against ours on the same train and validation text."""

    nanochat_dir: str | None = None
    """A checkout of karpathy/nanochat (its scripts/base_train.py is run from there)."""
    nanochat_python: str = sys.executable
    """The Python that runs nanochat (a venv with its packages: see the module docstring)."""
    nanochat_args: tuple[str, ...] = ()
    """More flags for nanochat's base_train, e.g. --matrix-lr 0.02 (after the bench's own)."""
    ours_args: tuple[str, ...] = ()
    """More flags for our base_train (after the bench's own)."""
    dataset_path: str | None = None
    """The corpus (our --dataset_path: a text file or a directory); default: the stdlib sources."""
    doc_chars: int = 1000
    """Documents are cut after a newline into pieces of at most this many characters; 0: whole."""
    depth: int = 2
    """Layers (an even one, of our presets); width 64 x depth on both sides."""
    vocab_size: int = 4096
    """Each project's BPE vocabulary, trained on the train split."""
    tokenizer_chars: int = 20_000_000
    """Characters of the train split each tokenizer trains on."""
    seq_len: int = 256
    """Tokens a sequence (nanochat's --max-seq-len)."""
    batch_size: int = 16
    """Sequences a step, in one forward pass (nanochat's --device-batch-size)."""
    num_iterations: int = 300
    """Optimizer steps of every run."""
    eval_every: int = 50
    """Steps between evaluations (both also evaluate at the end; nanochat at step 0 too)."""
    eval_tokens: int = 32768
    """Validation tokens per evaluation: a multiple of batch_size x seq_len (nanochat's batches)."""
    optimizer: tuple[Literal["adamw", "muon"], ...] = ("muon",)
    """Our optimizer(s): one of our runs per optimizer and seed."""
    lr: float | None = None
    """Our --lr (AdamW's peak rate); default: ours."""
    muon_lr: float | None = None
    """Our --muon_lr; default: ours."""
    packing: Literal["stream", "bestfit"] = "stream"
    """Our --packing (nanochat always packs best-fit from a document's start)."""
    fp8_opt_level: int = 0
    """Our --fp8_opt_level (optimizer moments in FP8)."""
    compile: bool = True
    """torch.compile both (nanochat: TORCHDYNAMO_DISABLE=1 when off)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where both train (nanochat's --device-type)."""
    seeds: tuple[int, ...] = (1,)
    """Our seeds; nanochat runs as often unless --nanochat_runs says fewer."""
    nanochat_runs: int | None = None
    """nanochat's runs, alternating with ours; default one per seed. It seeds itself (42), so its
    repeats differ in time only: 1 halves a quality sweep's cost. Our seed i is compared with
    nanochat's run i, or its last. 0: ours only, a part for --merge."""
    timeout_s: float = 3600.0
    """A training process still running after this is killed with its process group."""
    work_dir: str = "runs/bench_vs_nanochat"
    """Where the corpus, tokenizers, runs and logs go."""
    quick: bool = False
    """Tiny sizes, no compile: a dry run (tests); its figures mean nothing."""
    out: str | None = None
    """Write the figures as JSON here."""
    merge: tuple[str, ...] = ()
    """Run nothing: report these --out files of the same settings (seeds aside) as one run, e.g. a
    part with --nanochat_runs 1 and parts of other seeds with --nanochat_runs 0 (one file: its
    report again)."""

    def __post_init__(self) -> None:
        for name in ("depth", "vocab_size", "tokenizer_chars", "seq_len", "batch_size", "num_iterations",
                     "eval_every", "eval_tokens", "timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name} must be positive, got {getattr(self, name)}")
        if self.depth % 2:
            raise ValueError(f"--depth {self.depth}: an odd depth is 64 x depth wide, which nanochat rounds up to a "
                             "multiple of its 128-wide heads; use an even depth")
        if self.eval_tokens % (self.batch_size * self.seq_len):
            raise ValueError(f"--eval_tokens {self.eval_tokens} is not a multiple of batch_size x seq_len "
                             f"({self.batch_size * self.seq_len}): nanochat would evaluate fewer tokens than ours")
        if self.doc_chars < 0:
            raise ValueError(f"--doc_chars must be >= 0 (0 keeps documents whole), got {self.doc_chars}")
        if not self.seeds or not self.optimizer:
            raise ValueError("--seeds and --optimizer need at least one value")
        if self.nanochat_runs is not None and not 0 <= self.nanochat_runs <= len(self.seeds):
            raise ValueError(f"--nanochat_runs must be between 0 and the number of --seeds ({len(self.seeds)}), "
                             f"got {self.nanochat_runs}")


QUICK = dict(vocab_size=512, tokenizer_chars=400_000, seq_len=64, batch_size=4, num_iterations=6, eval_every=3,
             eval_tokens=512, compile=False, timeout_s=600.0)


# ------------------------------------------------------------------------------------- corpus
def split_corpus(dataset_path: str | None, doc_chars: int) -> tuple[list[str], list[str], str]:
    """The train and validation pieces of the corpus, and a line saying how it was split."""
    from nanochat.data.plan import iter_documents, plan_sources
    from nanochat.data.sources import DataError, list_sources
    from nanochat.data.split import VAL_FRACTION, val_hash

    plan = plan_sources(list_sources(dataset_path))
    if plan.kind != "text":
        raise DataError(f"--dataset_path {dataset_path}: instruction records; this benchmark compares "
                        "pretraining on plain text")
    docs = [(u.role, d.id, d.text) for u, d in iter_documents(plan)]
    by_role = any(role == "validation" for role, _, _ in docs)
    is_val = [role == "validation" if by_role else val_hash(i) < VAL_FRACTION for role, i, _ in docs]
    note = "split files" if by_role else f"sha1(doc id) < {VAL_FRACTION:g}"
    if not any(is_val) or all(is_val):
        if len(docs) < 2:
            raise DataError(f"--dataset_path {dataset_path}: {len(docs)} document(s); the split needs two")
        pick = (min if not any(is_val) else max)(range(len(docs)), key=lambda k: val_hash(docs[k][1]))
        is_val[pick] = not is_val[pick]
        note += "; one document moved to fill the empty side"
    train = [p for (_, _, text), v in zip(docs, is_val) if not v for p in pieces(text, doc_chars)]
    val = [p for (_, _, text), v in zip(docs, is_val) if v for p in pieces(text, doc_chars)]
    return train, val, note


def pieces(text: str, limit: int) -> list[str]:
    """`text` cut after newlines into pieces of at most `limit` characters (a longer line is cut
    inside); pieces of whitespace only are dropped (our reader skips them). 0: the text whole."""
    if limit == 0:
        return [text] if text.strip() else []
    out, cur = [], ""
    for line in text.splitlines(keepends=True):
        while len(line) > limit:
            out += [cur, line[:limit]]
            cur, line = "", line[limit:]
        if len(cur) + len(line) > limit:
            out.append(cur)
            cur = ""
        cur += line
    out.append(cur)
    return [p for p in out if p.strip()]


def write_corpus(train: list[str], val: list[str], work: Path, *, shard_docs: int = 20_000,
                 row_group: int = 1024) -> dict[str, Any]:
    """nanochat's data directory (train shards, then the validation shard last) and ours (links
    to the same files, named by split). Returns the paths and sizes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = work / "nanochat_base" / "base_data_climbmix"
    ours = work / "corpus"
    for d in (data, ours):
        d.mkdir(parents=True, exist_ok=True)
        for old in d.iterdir():  # a shard of an earlier, larger corpus would be read as data
            old.unlink()
    shards = [train[i:i + shard_docs] for i in range(0, len(train), shard_docs)]
    for i, docs in enumerate([*shards, val]):
        path = data / f"shard_{i:05d}.parquet"
        pq.write_table(pa.table({"text": docs}), path, row_group_size=row_group)
        name = "validation-00000.parquet" if i == len(shards) else f"train-{i:05d}.parquet"
        (ours / name).symlink_to(path.resolve())
    return dict(nanochat_data=str(data), ours_corpus=str(ours), train_docs=len(train), val_docs=len(val),
                train_chars=sum(map(len, train)), val_chars=sum(map(len, val)), train_shards=len(shards))


# ------------------------------------------------------------------------------ nanochat
VAL_LINE = re.compile(r"^Step (\d+) \| Validation bpb: (\S+)", re.M)
STEP_LINE = re.compile(r"^step (\d+)/(\d+) .*?\| dt: ([0-9.]+)ms \| tok/sec: ([0-9,]+)", re.M)
SDPA_LINE = re.compile(r"^WARNING: .*using PyTorch SDPA fallback", re.M | re.I)


def parse_nanochat_log(text: str, tokens_per_step: int) -> dict[str, Any]:
    """nanochat base_train's stdout: the val bpb curve, the throughput of its timed steps (after
    the first 10, as its own total time; all but the first when it ran 10 or fewer) and its
    attention: "sdpa" where it says it fell back to PyTorch's SDPA, else "fa3"."""
    val = [(int(s), float(v)) for s, v in VAL_LINE.findall(text)]
    dts = [(int(s), float(dt) / 1000) for s, _, dt, _ in STEP_LINE.findall(text)]
    timed = [dt for s, dt in dts if s > 10] or [dt for s, dt in dts if s > 0]
    return dict(val_step=[s for s, _ in val], val_bpb_curve=[v for _, v in val],
                val_bpb=val[-1][1] if val else None, steps=len(dts),
                tokens_per_sec=len(timed) * tokens_per_step / sum(timed) if timed else None,
                train_time_s=sum(dt for _, dt in dts), attention="sdpa" if SDPA_LINE.search(text) else "fa3")


def nanochat_commit(path: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def check_nanochat(cfg: BenchVsNanochatConfig) -> Path:
    """The checkout, after checking it and its Python hold what the runs need (before any work)."""
    if not cfg.nanochat_dir:
        raise ValueError("--nanochat_dir is missing: pass a checkout of karpathy/nanochat")
    from nanochat.model.gpt import PRESETS

    if f"d{cfg.depth}" not in PRESETS:
        raise ValueError(f"--depth {cfg.depth}: we have no d{cfg.depth} preset; choose among {', '.join(PRESETS)}")
    path = Path(cfg.nanochat_dir).resolve()
    for f in ("scripts/base_train.py", "scripts/tok_train.py", "nanochat/dataloader.py"):
        if not (path / f).is_file():
            raise ValueError(f"--nanochat_dir {path} has no {f}; pass the root of a karpathy/nanochat checkout")
    probe = ("import importlib.util as u, sys; m = [n for n in sys.argv[1:] if u.find_spec(n) is None]; "
             "print(' '.join(m))")
    try:
        missing = subprocess.run([cfg.nanochat_python, "-c", probe, *NANOCHAT_MODULES], capture_output=True,
                                 text=True, timeout=120, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError) as e:
        raise ValueError(f"--nanochat_python {cfg.nanochat_python} does not run ({e}); pass a Python 3 "
                         "interpreter") from None
    if missing:
        raise ValueError(f"--nanochat_python {cfg.nanochat_python} lacks {', '.join(missing)}: make a venv "
                         "for nanochat (bench/bench_vs_nanochat.py's docstring) and pass its python")
    return path


# -------------------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class Setup:
    cfg: BenchVsNanochatConfig
    nanochat: Path
    work: Path

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.cfg.seq_len

    @property
    def val_docs(self) -> Path:
        """The validation documents as a JSON list of strings: what common_bpb scores."""
        return self.work / "val_docs.json"

    def nanochat_env(self) -> dict[str, str]:
        env = {**os.environ, "NANOCHAT_BASE_DIR": str(self.work / "nanochat_base")}
        if not self.cfg.compile:
            env["TORCHDYNAMO_DISABLE"] = "1"
        return env

    def ours_env(self) -> dict[str, str]:
        return {**os.environ, "NANOCHAT_CACHE": str(self.work / "ours_cache")}

    def run(self, cmd: list[str], cwd: Path, env: dict[str, str], log: str, what: str) -> dict[str, Any]:
        """`cmd` to its end (or --timeout_s), its output in logs/<log>.log; one error unless it exits 0."""
        path = self.work / "logs" / f"{log}.log"
        r = harness.run_logged(cmd, cwd=cwd, env=env, log=path, timeout_s=self.cfg.timeout_s)
        return harness.checked(r, what, self.cfg.timeout_s)


def prepare(s: Setup) -> dict[str, Any]:
    """The corpus written once, each project's tokenizer trained on it, our token store built."""
    cfg, work = s.cfg, s.work
    t0 = time.perf_counter()
    train, val, note = split_corpus(cfg.dataset_path, cfg.doc_chars)
    corpus = write_corpus(train, val, work)
    s.val_docs.write_text(json.dumps(val))
    corpus.update(split=note, write_s=time.perf_counter() - t0)
    print(f"bench_vs_nanochat: corpus: train {corpus['train_docs']:,} docs / {corpus['train_chars']:,} chars, "
          f"val {corpus['val_docs']:,} docs / {corpus['val_chars']:,} chars ({note}; pieces of <= {cfg.doc_chars} "
          f"chars), {corpus['write_s']:.1f} s", flush=True)
    tok = str(work / "ours_tokenizer")
    steps = {
        "nanochat tokenizer": ([cfg.nanochat_python, "-m", "scripts.tok_train", "--vocab-size", str(cfg.vocab_size),
                                "--max-chars", str(cfg.tokenizer_chars)], s.nanochat, s.nanochat_env()),
        "our tokenizer": ([sys.executable, str(ROOT / "scripts/tok_train.py"), "--dataset_path", corpus["ours_corpus"],
                           "--tokenizer_dir", tok, "--vocab_size", str(cfg.vocab_size), "--max_chars",
                           str(cfg.tokenizer_chars), "--overwrite"], Path.cwd(), s.ours_env()),
        "our token store": ([sys.executable, str(ROOT / "scripts/tokenize_corpus.py"), "--dataset_path",
                             corpus["ours_corpus"], "--tokenizer_dir", tok], Path.cwd(), s.ours_env()),
    }
    times = {}
    for what, (cmd, cwd, env) in steps.items():
        r = s.run(cmd, cwd, env, what.replace(" ", "_"), what)
        times[what] = r["wall_time_s"]
        print(f"bench_vs_nanochat: {what}: {r['wall_time_s']:.1f} s", flush=True)
    fingerprints = dict(train=digest(json.dumps(train).encode()), val=digest(s.val_docs.read_bytes()),
                        nanochat_tokenizer=digest(*tree_bytes(work / "nanochat_base" / "tokenizer")),
                        our_tokenizer=digest(*tree_bytes(Path(tok))))
    return dict(corpus=corpus, prep_s=times, fingerprints=fingerprints)


def digest(*chunks: bytes) -> str:
    h = hashlib.sha1()
    for c in chunks:
        h.update(len(c).to_bytes(8, "little") + c)
    return h.hexdigest()[:16]


def tree_bytes(d: Path) -> list[bytes]:
    """Each file's name and bytes under `d`, in name order: what a tokenizer directory holds."""
    return [x for f in sorted(p for p in d.rglob("*") if p.is_file()) for x in (str(f.relative_to(d)).encode(),
                                                                               f.read_bytes())]


def run_nanochat(s: Setup, seed: int) -> dict[str, Any]:
    cfg = s.cfg
    cmd = [cfg.nanochat_python, "-m", "scripts.base_train", "--device-type", cfg.device, "--depth", str(cfg.depth),
           "--aspect-ratio", "64", "--head-dim", "128", "--window-pattern", "L", "--max-seq-len", str(cfg.seq_len),
           "--device-batch-size", str(cfg.batch_size), "--total-batch-size", str(s.tokens_per_step),
           "--num-iterations", str(cfg.num_iterations), "--eval-every", str(cfg.eval_every),
           "--eval-tokens", str(cfg.eval_tokens), "--core-metric-every", "-1", "--sample-every", "-1",
           "--save-every", str(cfg.eval_every), "--run", "dummy", "--model-tag", f"bench-{seed}",
           *cfg.nanochat_args]
    r = s.run(cmd, s.nanochat, s.nanochat_env(), f"nanochat-{seed}", f"nanochat run {seed}")
    record = parse_nanochat_log(r["text"], s.tokens_per_step)
    if record["val_bpb"] is None:
        raise NanoChatError(f"nanochat run {seed} printed no validation bpb; its log: {r['log']}")
    record = own_curve(dict(record, wall_time_s=r["wall_time_s"], log=r["log"], loadavg=harness.load()))
    steps = [st for st in record["own_val_step"] if st > 0]
    cmd = [cfg.nanochat_python, str(ROOT / "bench/score_nanochat.py"), "--checkout", str(s.nanochat), "--base_dir",
           str(s.work / "nanochat_base"), "--model_tag", f"bench-{seed}", "--docs", str(s.val_docs),
           "--seq_len", str(cfg.seq_len), "--device", cfg.device, "--steps", *map(str, steps)]
    scored = s.run(cmd, s.nanochat, s.nanochat_env(), f"nanochat-{seed}-scores", f"scoring nanochat run {seed}")
    figures = json.loads(scored["text"].strip().splitlines()[-1])
    return finished("nanochat", seed, with_common(record, figures["steps"], figures["bpb"]))


def run_ours(s: Setup, optimizer: str, seed: int) -> dict[str, Any]:
    cfg = s.cfg
    run_dir = s.work / "runs" / f"ours-{optimizer}" / f"seed-{seed}"
    cmd = [sys.executable, str(ROOT / "scripts/base_train.py"), "--model_name", f"d{cfg.depth}",
           "--dataset_path", str(s.work / "corpus"), "--tokenizer_dir", str(s.work / "ours_tokenizer"),
           "--seq_len", str(cfg.seq_len), "--batch_size", str(cfg.batch_size), "--num_iterations",
           str(cfg.num_iterations), "--eval_every", str(cfg.eval_every), "--eval_tokens", str(cfg.eval_tokens),
           "--seed", str(seed), "--device", cfg.device, "--optimizer", optimizer, "--packing", cfg.packing,
           "--fp8_opt_level", str(cfg.fp8_opt_level), "--compile" if cfg.compile else "--no_compile",
           "--save_every", str(cfg.eval_every), "--keep_checkpoints", str(cfg.num_iterations // cfg.eval_every + 1),
           "--num_samples", "0", "--no_plot", "--run_dir", str(run_dir), "--overwrite",
           *(["--lr", str(cfg.lr)] if cfg.lr is not None else []),
           *(["--muon_lr", str(cfg.muon_lr)] if cfg.muon_lr is not None else []), *cfg.ours_args]
    name = f"ours-{optimizer}"
    r = s.run(cmd, Path.cwd(), s.ours_env(), f"{name}-{seed}", f"our run ({optimizer}, seed {seed})")
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [e for e in evals if isinstance(e.get("val_bpb"), (int, float))]
    result = json.loads((run_dir / "result.json").read_text())
    record = own_curve(dict(val_step=[e["step"] for e in evals], val_bpb_curve=[e["val_bpb"] for e in evals],
                            val_bpb=result["val_bpb"], steps=result["steps"], tokens_per_sec=result["tokens_per_sec"],
                            wall_time_s=r["wall_time_s"], log=r["log"], run_dir=str(run_dir), loadavg=harness.load()))
    steps = record["own_val_step"]
    import common_bpb  # torch: not imported for --help

    bpb = common_bpb.score_run(run_dir, steps, json.loads(s.val_docs.read_text()), cfg.seq_len, cfg.device)
    return finished(name, seed, with_common(record, steps, bpb))


def own_curve(record: dict[str, Any]) -> dict[str, Any]:
    """The run's figures with its own evaluator's curve renamed own_* (the common one takes val_*)."""
    record = dict(record)
    for k in ("val_step", "val_bpb_curve", "val_bpb"):
        record["own_" + k] = record.pop(k)
    return record


def with_common(record: dict[str, Any], steps: list[int], bpb: list[float]) -> dict[str, Any]:
    return dict(record, val_step=list(steps), val_bpb_curve=list(bpb), val_bpb=bpb[-1])


def finished(name: str, seed: int, record: dict[str, Any]) -> dict[str, Any]:
    tps = record["tokens_per_sec"]
    print(f"bench_vs_nanochat: {name} {seed}: val bpb {record['val_bpb']:.4f} (its own evaluator's "
          f"{record['own_val_bpb']:.4f}), "
          f"{'-' if tps is None else f'{tps:,.0f}'} tok/s, {record['wall_time_s']:.0f} s ({record['loadavg']})",
          flush=True)
    return record


# ------------------------------------------------------------------------------------- bench
def bench(cfg: BenchVsNanochatConfig) -> dict:
    if cfg.merge:
        return vs_nanochat_report.merge(cfg.merge)
    s = Setup(cfg, check_nanochat(cfg), Path(cfg.work_dir).resolve())
    prep = prepare(s)
    k = len(cfg.seeds) if cfg.nanochat_runs is None else cfg.nanochat_runs
    variants = {"nanochat": lambda i: run_nanochat(s, cfg.seeds[i]) if i < k else None}
    variants.update({f"ours-{o}": (lambda i, o=o: run_ours(s, o, cfg.seeds[i])) for o in cfg.optimizer})
    runs = harness.interleave(variants, len(cfg.seeds))
    runs["nanochat"] = runs["nanochat"][:k]
    config, commit = dataclasses.asdict(cfg), nanochat_commit(s.nanochat)
    comparisons = vs_nanochat_report.report(config, runs, commit)
    return dict(config=config, nanochat_commit=commit, **prep, comparisons=comparisons, runs=runs)


def main(argv: list[str] | None = None) -> int:
    return harness.main(BenchVsNanochatConfig, bench, argv, quick=QUICK)


if __name__ == "__main__":
    sys.exit(main())
