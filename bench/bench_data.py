"""Benchmark the data path on corpora of two sizes: the token store against the in-memory path.

    .venv/bin/python bench/bench_data.py                  # 100 and 400 MiB of text, ~6 min on 2 cores
    .venv/bin/python bench/bench_data.py --quick          # 2 and 8 MiB: a dry run

Two corpora of generated text (pseudo-words with Zipf frequencies, documents of ~4 KB) are
written as parquet shards in nanochat's layout (`shard_00000.parquet`, a `text` column, row
groups of 1024 documents, zstd), once, under --work_dir. One tokenizer (scripts/tok_train.py, on
the smaller corpus) serves both. For each corpus, every figure from its own process:
  build          scripts/tokenize_corpus.py: text MB/s (the store's build time), peak RSS of the
                 builder and of its largest worker (forked: their RSS counts pages they share);
  cached start   scripts/base_train.py, a d2 for --steps steps with the store built: peak RSS,
                 wall time, and the seconds spent in RunData.load (listing, store, batches);
  data only      the store opened and --steps batches drawn (candidate), against the in-memory
                 path (tests/reference_data.py's load_corpus + tokenize_docs with its token
                 cache, as a run read its data before the store): peak RSS and seconds, first
                 start and cached start.
Then the 400/100 ratios against their goals, a --ranks torchrun on the larger corpus (each
rank's peak RSS, recorded by the rank itself when its script returns, so a rank that hangs at
exit is still measured and then killed by its pid), and the sizing of a 40 GB corpus on 8 ranks
from the per-byte slopes. Figures go to stdout and, with --out, to JSON.

The in-memory path is the store's tests' reference (tests/reference_data.py: the documents,
split and tokens a store holds, as Python strings and one tensor), measured here as the baseline.
Every measured process runs under RUNNER, which records its peak RSS (harness.peak_rss_mb) and
wall time as it exits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Literal
from pathlib import Path

import harness
from nanochat.common import format_table

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPTS = ROOT / "scripts"
SHARD_MIB = 25
"""Text per generated shard (nanochat's ClimbMix shards hold ~250 MB; smaller here so that even
the small corpus has several)."""

RUNNER = r'''
import json, os, runpy, sys, time
t0 = time.time()
bench_dir, out, script, *args = sys.argv[1:]
path = f"{out}.rank{os.environ.get('RANK', '0')}"
with open(path + ".pid", "w") as f:
    f.write(str(os.getpid()))
timing = {}
if script.endswith("base_train.py"):  # the seconds a run spends on its data
    import nanochat.train.run_data as rd
    real = rd.RunData.load.__func__
    def load(cls, *a, **k):
        t = time.time()
        result = real(cls, *a, **k)
        timing["data_s"] = time.time() - t
        timing["data_done_s"] = time.time() - t0
        return result
    rd.RunData.load = classmethod(load)
sys.argv = [script, *args]
rc = 0
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as e:
    rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
finally:
    sys.path.insert(0, bench_dir)  # only now: the harness is no part of what is measured
    from harness import peak_rss_mb
    with open(path + ".json", "w") as f:
        json.dump({"rc": rc, "rss_mb": peak_rss_mb(), "wall_s": time.time() - t0, **timing}, f)
sys.exit(rc)
'''

IN_MEMORY = r'''
import json, sys, time
sys.path.insert(0, sys.argv[4])  # the repository: the in-memory path is the tests' reference
from tests.reference_data import load_corpus, tokenize_docs
from nanochat.tokenizer import BPETokenizer
tok = BPETokenizer.load(sys.argv[2])
t0 = time.time()
corpus = load_corpus(sys.argv[1])
t1 = time.time()
train = tokenize_docs(tok, corpus.train_docs, cache_dir=sys.argv[3])
tokenize_docs(tok, corpus.val_docs, cache_dir=sys.argv[3])
t2 = time.time()
print("RESULT " + json.dumps({"read_s": t1 - t0, "tokenize_s": t2 - t1, "seconds": t2 - t0,
                              "text_bytes": corpus.num_bytes, "tokens": len(train)}))
'''

STORE_DATA = r'''
import json, sys, time
from nanochat.common import cache_root
from nanochat.data.batches import TokenBatches
from nanochat.data.prepare import prepare_data
from nanochat.tokenizer import BPETokenizer
tok = BPETokenizer.load(sys.argv[2])
t0 = time.time()
store = prepare_data(sys.argv[1], tokenizer=tok, cache_root=cache_root()).store
loader = TokenBatches(store.train, seq_len=int(sys.argv[3]), batch_size=int(sys.argv[4]), seed=0)
for _ in range(int(sys.argv[5])):
    loader.next_batch()
print("RESULT " + json.dumps({"seconds": time.time() - t0}))
'''


@dataclass(frozen=True, kw_only=True)
class BenchDataConfig:
    """The token store against the in-memory data path on two corpus sizes (module docstring)."""

    sizes_mib: tuple[int, int] = (100, 400)
    """Text in the two generated corpora, MiB (the ratios are the second over the first)."""
    work_dir: str = "runs/bench_data"
    """Corpora (generated once, kept), tokenizer, stores and runs."""
    steps: int = 5
    """Training steps of each run (d2, --no_compile)."""
    seq_len: int = 256
    batch_size: int = 8
    vocab_size: int = 4096
    """Tokenizer trained on the smaller corpus (scripts/tok_train.py, its first 20M characters)."""
    repeats: int = 3
    """Measurements of each figure per corpus (the sizes alternate); medians are reported."""
    ranks: int = 2
    """Processes of the torchrun on the larger corpus (0: skip it)."""
    optimizer: Literal["auto", "adamw", "muon"] = "auto"
    """The trainer's --optimizer (auto: its default, Muon + AdamW for a size preset). The figures
    BENCHMARKS.md dates before the Muon default trained AdamW: repeat them with adamw."""
    timeout: int = 600
    """Seconds any one measured process may take; a torchrun past it is killed (its ranks by pid)."""
    quick: bool = False
    """Corpora of 2 and 8 MiB: a dry run in a minute."""
    out: str | None = None
    """Write every figure as JSON here."""

    def __post_init__(self) -> None:
        if len(self.sizes_mib) != 2 or not 0 < self.sizes_mib[0] < self.sizes_mib[1]:
            raise ValueError(f"--sizes_mib needs two increasing sizes, e.g. 100 400; got {self.sizes_mib}")
        for name in ("steps", "seq_len", "batch_size", "timeout", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")


QUICK = dict(sizes_mib=(2, 8), seq_len=64, vocab_size=512)


# ---------------------------------------------------------------- corpora
def generate_corpus(path: Path, mib: int, seed: int) -> int:
    """Write `mib` MiB of generated text as parquet shards into `path`; returns its UTF-8 bytes.
    Deterministic in (mib, seed); kept and reused when its marker file says it is complete."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    marker = path / ".complete"
    if marker.is_file():
        return int(marker.read_text())
    path.mkdir(parents=True, exist_ok=True)
    for old in path.glob("shard_*.parquet"):
        old.unlink()
    lexicon_rng, rng = np.random.default_rng(1234), np.random.default_rng(seed)
    consonants = list("bcdfghjklmnprstvwz") + ["th", "st", "ch", "sh", "tr", "pl", "qu", "br"]
    vowels = ["a", "e", "i", "o", "u", "ea", "ou", "io", "ai", "y"]
    syllables = [c + v for c in consonants for v in vowels]
    words: set[str] = set()
    while len(words) < 30_000:
        words.add("".join(lexicon_rng.choice(syllables, size=lexicon_rng.integers(1, 5))))
    lexicon = sorted(words)
    lexicon_rng.shuffle(lexicon)
    n = len(lexicon)
    # every word in 8 forms: lower / capitalized, then " ", ", ", ". ", ".\n\n"
    forms = np.array([(w.capitalize() if cap else w) + end for cap in (False, True) for w in lexicon
                      for end in (" ", ", ", ". ", ".\n\n")], dtype=object)
    p = 1.0 / (np.arange(n) + 2.7) ** 1.1  # Zipf-like word frequencies
    p /= p.sum()
    target, total, shard, docs, shard_bytes = mib << 20, 0, 0, [], 0
    while total < target:
        m = 1 << 21
        word = rng.choice(n, size=m, p=p)
        end = rng.choice(4, size=m, p=[0.86, 0.07, 0.055, 0.015])
        capital = np.roll(end >= 2, 1)  # after a full stop
        capital[0] = True
        text = forms[(word + n * capital) * 4 + end]
        pos = 0
        for length in np.maximum(20, rng.lognormal(np.log(600), 0.8, size=m // 300).astype(int)):
            if pos + length > m or total >= target:
                break
            doc = "".join(text[pos:pos + length]).rstrip() + "\n"
            pos += length
            docs.append(doc)
            nbytes = len(doc.encode("utf-8"))
            shard_bytes, total = shard_bytes + nbytes, total + nbytes
            if shard_bytes >= SHARD_MIB << 20 or total >= target:
                pq.write_table(pa.table({"text": docs}), path / f"shard_{shard:05d}.parquet", row_group_size=1024,
                               use_dictionary=False, compression="zstd", compression_level=3, write_statistics=False)
                shard, docs, shard_bytes = shard + 1, [], 0
    marker.write_text(str(total))
    return total


# ---------------------------------------------------------------- measuring
def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "NANOCHAT_CACHE": str(cache), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}


def _descendants(root: int) -> list[int]:
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parents[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out, frontier = [], [root]
    while frontier:
        frontier = [p for p, pp in parents.items() if pp in frontier]
        out += frontier
    return out


EXIT_GRACE_S = 30
"""Seconds a torchrun may take to exit once rank 0 has recorded its figures (a 2-rank gloo run can
hang in its process group's destructor); then its ranks are killed and it is reported so."""


def _run(cmd: list[str], env: dict[str, str], timeout: int, log: Path, peaks: dict[int, float] | None = None,
         finished: int = 0) -> tuple[int | None, float, str]:
    """(exit status, or None when killed, wall seconds, output tail). Killed after `timeout`, or
    EXIT_GRACE_S after `finished` ranks wrote their figures next to `log`; the process group and
    every rank that wrote a pid file are killed (torchrun's ranks run in sessions of their own).
    `peaks`: filled with the peak RSS of every descendant process, sampled every 0.2 s (workers,
    and ranks that never return to record their own)."""
    t0 = time.perf_counter()
    deadline = t0 + timeout
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        rc = None
        while rc is None and time.perf_counter() < deadline:
            if peaks is not None:
                for pid in _descendants(proc.pid):
                    hwm = harness.peak_rss_mb(pid)
                    if hwm is not None:
                        peaks[pid] = max(peaks.get(pid, 0.0), hwm)
            if finished and len(list(log.parent.glob(f"{log.stem}.rank*.json"))) >= finished:
                deadline = min(deadline, time.perf_counter() + EXIT_GRACE_S)
            try:
                rc = proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
        if rc is None:
            for pid_file in log.parent.glob(f"{log.stem}.rank*.pid"):
                try:
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)  # torchrun's ranks: sessions of their own
                except (OSError, ValueError):
                    pass
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return rc, time.perf_counter() - t0, log.read_text()[-3000:]


def _measured(script: Path, args: list[str], env: dict[str, str], cfg: BenchDataConfig, out: Path,
              torchrun: int = 0, poll: bool = False) -> dict:
    """Run `script` under the RSS-recording runner; its per-rank figures, and with `poll` the
    largest peak RSS of its other processes (the build's workers). Its output goes to `out`.log."""
    runner = out.parent / "_runner.py"
    runner.write_text(RUNNER)
    for old in out.parent.glob(f"{out.name}.rank*"):
        old.unlink()
    py = [sys.executable]
    if torchrun:
        py = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"]
    peaks: dict[int, float] = {}
    rc, wall, tail = _run([*py, str(runner), str(HERE), str(out), str(script), *args], env, cfg.timeout,
                          out.with_suffix(".log"), peaks if poll or torchrun else None, finished=1 if torchrun else 0)
    ranks, pids = {}, {}
    for f in sorted(out.parent.glob(f"{out.name}.rank*.pid")):
        rank = f.name.split(".rank")[1].split(".")[0]
        pids[rank] = int(f.read_text())
        recorded = out.parent / f"{out.name}.rank{rank}.json"
        if recorded.is_file():
            ranks[rank] = json.loads(recorded.read_text())
        elif pids[rank] in peaks:  # a rank that did not return: its peak as sampled from outside
            ranks[rank] = {"rc": 0, "rss_mb": peaks[pids[rank]], "hung": True}
    if "0" not in ranks or any(r["rc"] != 0 for r in ranks.values()):
        raise RuntimeError(f"{script.name} {' '.join(args)} failed (exit {rc}):\n{tail}")
    for rank, pid in pids.items():  # sampled VmHWM and the rank's own, whichever saw more
        ranks[rank]["rss_mb"] = max(ranks[rank]["rss_mb"], peaks.get(pid, 0.0))
    others = [v for pid, v in peaks.items() if pid not in pids.values()]
    return {"exit": rc, "wall_s": wall, "ranks": ranks, "children_rss_mb": max(others, default=0.0),
            **ranks.get("0", {})}


def _snippet(code: str, args: list[str], env: dict[str, str], cfg: BenchDataConfig, out: Path) -> dict:
    """A Python snippet in a process of its own: its RESULT line, peak RSS and wall time."""
    script = out.parent / f"{out.name}.py"
    script.write_text(code)
    measured = _measured(script, args, env, cfg, out)
    lines = out.with_suffix(".log").read_text().splitlines()
    result = json.loads(next(line for line in lines if line.startswith("RESULT "))[7:])
    return {**result, "rss_mb": measured["rss_mb"], "wall_s": measured["wall_s"]}


def _sample(cfg: BenchDataConfig, work: Path, mib: int, path: Path, tok_dir: Path, run_args: list[str]) -> dict:
    """One repeat at one size: the store built from nothing, the in-memory path right after it (the
    same load), a short run, the store's data path alone, and the in-memory path from its cache."""
    cache = work / f"cache-{mib}mib"
    for sub in ("stores", "tokens"):  # a build from nothing; the generated corpus and tokenizer are kept
        shutil.rmtree(cache / sub, ignore_errors=True)
    env = _env(cache)
    r: dict = {}
    r["build"] = _measured(SCRIPTS / "tokenize_corpus.py", ["--dataset_path", str(path), "--tokenizer_dir", str(tok_dir)],
                           env, cfg, work / f"build-{mib}", poll=True)
    manifest = json.loads(next((cache / "stores").glob("*/tokens-*/manifest.json")).read_text())
    r["build"].update(seconds=manifest["build"]["seconds"], workers=manifest["build"]["workers"],
                      store_bytes=sum(f["bytes"] for f in manifest["files"].values()),
                      tokens=manifest["split"]["train"]["tokens"] + manifest["split"]["val"]["tokens"])
    memory_args = [str(path), str(tok_dir), str(cache / "tokens"), str(ROOT)]
    r["memory_first"] = _snippet(IN_MEMORY, memory_args, env, cfg,
                                 work / f"memory-first-{mib}")  # right after the build: the same load
    r["build_vs_memory"] = (r["memory_first"]["tokenize_s"] / r["build"]["seconds"])
    r["run"] = _measured(SCRIPTS / "base_train.py", run_args, env, cfg, work / f"run-{mib}")
    r["store_data"] = _snippet(STORE_DATA, [str(path), str(tok_dir), str(cfg.seq_len), str(cfg.batch_size),
                                            str(cfg.steps)], env, cfg, work / f"store-data-{mib}")
    r["memory_cached"] = _snippet(IN_MEMORY, memory_args, env, cfg, work / f"memory-cached-{mib}")
    r["loadavg"] = os.getloadavg()[0]
    return r


def bench(cfg: BenchDataConfig) -> dict:
    work = Path(cfg.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    corpora = {mib: work / f"corpus-{mib}mib" for mib in cfg.sizes_mib}
    text_bytes = {}
    for i, (mib, path) in enumerate(corpora.items()):
        print(f"corpus {mib} MiB: {path}", flush=True)
        text_bytes[mib] = generate_corpus(path, mib, seed=i)
    small, large = cfg.sizes_mib
    tok_dir = work / f"tokenizer-{small}mib-{cfg.vocab_size}"
    if not (tok_dir / "tokenizer_meta.json").is_file():
        rc, _, tail = _run([sys.executable, str(SCRIPTS / "tok_train.py"), "--dataset_path", str(corpora[small]),
                            "--tokenizer_dir", str(tok_dir), "--vocab_size", str(cfg.vocab_size)],
                           _env(work / "cache-tok"), cfg.timeout, work / "tok_train.log")
        if rc != 0:
            raise RuntimeError(f"tok_train failed:\n{tail}")
    results: dict = {"config": dataclasses.asdict(cfg), "text_bytes": text_bytes, "loadavg": os.getloadavg()[0]}
    train_args = lambda mib, run: ["--model_name", "d2", "--dataset_path", str(corpora[mib]), "--tokenizer_dir",  # noqa: E731
                                   str(tok_dir), "--seq_len", str(cfg.seq_len), "--batch_size", str(cfg.batch_size),
                                   "--num_iterations", str(cfg.steps), "--warmup_steps", "1", "--eval_every", "0",
                                   "--eval_tokens", str(cfg.seq_len * cfg.batch_size), "--num_samples", "0",
                                   "--no_compile", "--no_save_checkpoints", "--device", "cpu", "--optimizer", cfg.optimizer,
                                   "--run_dir", str(work / f"run-{run}"), "--overwrite"]

    def sample(mib: int, path: Path):
        def one(i: int) -> dict:
            print(f"{mib} MiB, repeat {i + 1}/{cfg.repeats}: build, {cfg.steps}-step run, data only", flush=True)
            return _sample(cfg, work, mib, path, tok_dir, train_args(mib, f"{mib}"))
        return one

    # the sizes alternate, so that the machine's load hits both alike
    samples = harness.interleave({mib: sample(mib, path) for mib, path in corpora.items()}, cfg.repeats)
    for mib in corpora:
        results[str(mib)] = {key: harness.median_of(r[key] for r in samples[mib]) for key in samples[mib][0]
                             if key not in ("loadavg", "build_vs_memory")}
        results[str(mib)]["build_vs_memory"] = statistics.median(r["build_vs_memory"] for r in samples[mib])
        results[str(mib)]["loadavg"] = [r["loadavg"] for r in samples[mib]]
        results[str(mib)]["samples"] = samples[mib]
    if cfg.ranks > 1:
        print(f"{large} MiB: torchrun with {cfg.ranks} ranks", flush=True)
        results["ranks"] = _measured(SCRIPTS / "base_train.py", train_args(large, f"{large}-ranks"), _env(work / f"cache-{large}mib"),
                                     cfg, work / f"ranks-{large}", torchrun=cfg.ranks)
    report(cfg, results)
    return results


def report(cfg: BenchDataConfig, res: dict) -> None:
    small, large = (str(s) for s in cfg.sizes_mib)
    mb = lambda b: b / 1e6  # noqa: E731
    rows = []
    for mib in (small, large):
        r = res[mib]
        text = res["text_bytes"][int(mib)]
        rows.append([
            f"{mib} MiB", f"{mb(text) / r['build']['seconds']:.1f}", f"{r['build']['rss_mb']:,.0f} / {r['build']['children_rss_mb']:,.0f}",
            f"{r['build']['store_bytes'] / text:.3f}", f"{r['run']['rss_mb']:,.0f}", f"{r['run']['wall_s']:.1f}",
            f"{r['run']['data_s']:.2f}", f"{r['store_data']['rss_mb']:,.0f} / {r['store_data']['seconds']:.2f}",
            f"{mb(text) / r['memory_first']['tokenize_s']:.1f}",
            f"{r['memory_first']['rss_mb']:,.0f} / {r['memory_cached']['rss_mb']:,.0f}",
            f"{r['memory_cached']['seconds']:.2f}"])
    print()
    print(format_table(["corpus", "build MB/s", "build RSS MB (main / worker)", "store B per text B",
                        f"{cfg.steps}-step run RSS MB", "run wall s", "run data s", "store data RSS MB / s",
                        "in-memory tokenize MB/s", "in-memory RSS MB (first / cached)", "in-memory cached s"], rows))

    def ratio(key: str, field: str) -> float:
        return res[large][key][field] / res[small][key][field]

    goals = [
        ("cached-start peak RSS ratio", ratio("run", "rss_mb"), "<=", 1.15),
        ("cached-start wall ratio", ratio("run", "wall_s"), "<=", 1.3),
        ("build throughput vs in-memory tokenization (larger corpus; median of the repeats' ratios, each "
         "measured back to back)", res[large]["build_vs_memory"], ">=", 1.0),
    ]
    if "ranks" in res:
        worst = max(r["rss_mb"] for r in res["ranks"]["ranks"].values())
        goals.append((f"{cfg.ranks} ranks on {large} MiB, worst rank's RSS / 1 rank on {small} MiB",
                      worst / res[small]["run"]["rss_mb"], "<=", 1.15))
    print()
    for name, value, op, goal in goals:
        ok = value <= goal if op == "<=" else value >= goal
        print(f"{name}: {value:.3f}x (goal {op} {goal}x) {'met' if ok else 'NOT met'}")
    print(f"build vs in-memory tokenization, {small} MiB: {res[small]['build_vs_memory']:.3f}x; per repeat: "
          + "; ".join(f"{m} MiB " + ", ".join(f"{r['build_vs_memory']:.2f}x" for r in res[m]["samples"]) for m in (small, large)))
    print(f"other ratios {large}/{small}: run data seconds {ratio('run', 'data_s'):.2f}x, store data-only RSS "
          f"{ratio('store_data', 'rss_mb'):.2f}x, in-memory cached RSS {ratio('memory_cached', 'rss_mb'):.2f}x, "
          f"in-memory cached seconds {ratio('memory_cached', 'seconds'):.2f}x")
    if "ranks" in res:
        per_rank = ", ".join(f"rank {k}: {r['rss_mb']:,.0f} MB" + (" (sampled: it did not return)" if r.get("hung") else "")
                             for k, r in sorted(res["ranks"]["ranks"].items()))
        hung = ("" if res["ranks"]["exit"] == 0 else
                f" (torchrun did not exit {EXIT_GRACE_S} s after the ranks' results: killed)" if res["ranks"]["exit"] is None
                else f" (torchrun exit {res['ranks']['exit']})")
        print(f"torchrun {cfg.ranks} ranks on {large} MiB: {per_rank}; wall {res['ranks']['wall_s']:.1f} s{hung}")
    # 40 GB on 8 ranks, from the per-byte slopes between the two corpora
    target = 40e9
    span = res["text_bytes"][int(large)] - res["text_bytes"][int(small)]
    at = lambda key, field: res[small][key][field] + (res[large][key][field] - res[small][key][field]) / span * (  # noqa: E731
        target - res["text_bytes"][int(small)])
    per_core = mb(res["text_bytes"][int(large)]) / res[large]["build"]["seconds"] / res[large]["build"]["workers"]
    store_ratio = res[large]["build"]["store_bytes"] / res["text_bytes"][int(large)]
    print(f"\n40 GB of text on 8 ranks, extrapolated linearly from the two corpora: store run peak RSS {at('run', 'rss_mb'):,.0f} MB "
          f"per rank, data load {max(at('run', 'data_s'), 0):.1f} s; in-memory path cached start "
          f"{at('memory_cached', 'rss_mb') / 1e3:,.0f} GB per rank ({8 * at('memory_cached', 'rss_mb') / 1e3:,.0f} GB "
          f"for 8) and {at('memory_cached', 'seconds'):,.0f} s; store on disk {store_ratio * target / 1e9:.1f} GB; build "
          f"{per_core:.1f} MB/s per core: {target / 1e6 / per_core / 32 / 60:.0f} min on 32 cores")


def main(argv: list[str] | None = None) -> int:
    return harness.main(BenchDataConfig, bench, argv, quick=QUICK)


if __name__ == "__main__":
    sys.exit(main())
