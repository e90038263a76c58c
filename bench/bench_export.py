"""Plain vs FP8 export on the CPU ARC example: size, export time, logit SQNR and accuracy.

    python bench/bench_export.py                     # the example as benchmarked (~3 min on 2 cores)
    python bench/bench_export.py --quick             # seconds: a dry run
    python bench/bench_export.py --large             # also a Llama-3.2-1B shape: size and time at scale

The example is the documents' flagship (`--model_name meta-llama/Meta-Llama-3-8B --dataset_path
data/arc --fp8`) scaled to a CPU: a Llama built here by transformers (random weights, nothing
downloaded), a byte-level BPE tokenizer and ARC-shaped multiple choice in the hub's layout, all
written to --work_dir; fine-tuned by NanoChatTrainer with --fp8 --fp8_emulate; then exported
three ways in one process, each --repeats times: plain (fp32, the baseline), fp8 (per output
channel) and fp8_block (128x128). Measured per export: model.safetensors bytes and bytes per
parameter, the median export time and its ratio to plain; the logits' SQNR against the plain
export on the validation prompts, as transformers serves the export (e4m3 weights and per-token
activations, what vLLM computes) and as nanochat loads it (weights dequantized); and validation
accuracy scored both ways (option log-likelihood, nanochat.train.evaluation.choice_counts). --out
writes the figures as JSON. --large also exports a Llama-3.2-1B-shaped model (1.24B parameters,
random weights of std 0.02, no tokenizer) the three ways once each: size and time at scale.
BENCHMARKS.md records the figures.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import harness
from nanochat.common import UsageError, cache_root, format_table, setup_logging

# torch and the modules that load it are imported in the functions that use them: --help stays fast
if TYPE_CHECKING:
    import torch

WORDS = "red green blue cat dog fish sun moon star tree rock sand water fire ice wind".split()
KINDS = ("none", "fp8", "fp8_block")


@dataclass(frozen=True, kw_only=True)
class BenchExportConfig:
    """Plain vs FP8 export of the CPU ARC example."""

    work_dir: str = "runs/bench_export"
    """Where the model, data, run and exports are written (replaced)."""
    hidden_size: int = 256
    """Model width; a multiple of 128 so fp8_block has whole blocks."""
    intermediate_size: int = 768
    layers: int = 4
    steps: int = 60
    """Fine-tuning steps (batch 8 x 128 tokens, emulated FP8)."""
    repeats: int = 3
    """Exports of each kind; the median time is reported."""
    quick: bool = False
    """A dry run: width 128, 2 layers, 2 steps, 1 repeat (QUICK)."""
    out: str | None = None
    """Write the figures as JSON here."""
    large: bool = False
    """Also export a Llama-3.2-1B-shaped model (5 GB of fp32 weights, about 7 GB written)."""

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.steps < 1:
            raise ValueError("--repeats and --steps must be >= 1")
        if self.hidden_size % 128 or self.intermediate_size % 128:
            raise ValueError("--hidden_size and --intermediate_size must be multiples of 128 (fp8_block's blocks)")


QUICK = dict(hidden_size=128, intermediate_size=256, layers=2, steps=2, repeats=1)


def arc_rows(n: int, split: str, seed: int) -> list[dict]:
    """ARC-shaped rows whose answers lean to the first option: something a short run can learn."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        opts = rng.sample(WORDS, 4)
        key = 0 if rng.random() < 0.7 else rng.randrange(4)
        rows.append({"id": f"{split}_{i}", "question": f"{split} question {i}: which is {opts[key]}?",
                     "choices": {"text": opts, "label": list("ABCD")}, "answerKey": "ABCD"[key]})
    return rows


def build_example(root: Path, cfg: BenchExportConfig) -> tuple[Path, Path]:
    """(model dir, data dir): a seeded Llama with its tokenizer, and ARC-Challenge parquet files."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from tokenizers import decoders
    import torch
    import transformers

    data = root / "arc"
    (data / "ARC-Challenge").mkdir(parents=True)
    for split, n, seed in (("train", 400, 0), ("validation", 100, 1), ("test", 20, 2)):
        pq.write_table(pa.Table.from_pylist(arc_rows(n, split, seed)),
                       data / "ARC-Challenge" / f"{split}-00000-of-00001.parquet")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [json.dumps(r) for r in arc_rows(200, "train", 9)] + ["Answer: A B C D"] * 5
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=512, show_progress=False,
                                                       special_tokens=["<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model_dir = root / "base"
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(model_dir)
    torch.manual_seed(0)
    hidden = cfg.hidden_size
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden,
                                      intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.layers,
                                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128),
                                      head_dim=64,
                                      max_position_embeddings=256, bos_token_id=0, eos_token_id=1)
    transformers.LlamaForCausalLM(config).save_pretrained(model_dir)
    return model_dir, data


def distribution_sqnr() -> list[list[str]]:
    """Weight SQNR of the FP8 copy (per channel, per 128x128 block) of 1024 x 1024 weights of several
    distributions, next to e4m3's worst case 20 log10 17 = 24.6 dB (values halfway between two
    e4m3 values after scaling): where SQNR_FLOOR_DB comes from."""
    from compressed_tensors.quantization import preset_name_to_scheme
    import torch

    from nanochat.model.hf_fp8 import dequantize_weight, quantize_weight, sqnr_db

    g = torch.Generator().manual_seed(0)
    n = 1024
    gauss = torch.randn(n, n, generator=g)
    row_amax = gauss.abs().amax(dim=1, keepdim=True)
    halfway = 1.0625 * 2.0 ** torch.randint(3, 9, (n, n), generator=g).float() * 2.0 ** -10
    halfway = halfway * (torch.randint(0, 2, (n, n), generator=g) * 2 - 1)
    halfway[:, 0] = 448 * 2.0 ** -10
    weights = {
        "Gaussian": gauss,
        "Laplace": torch.distributions.Laplace(0.0, 1.0).sample((n, n)),
        "Student-t, 3 degrees": torch.distributions.StudentT(3.0).sample((n, n)),
        "uniform": torch.rand(n, n, generator=g) * 2 - 1,
        "int8 grid (per-row absmax)": (gauss / row_amax * 127).round() * row_amax / 127,
        "worst case (halfway values)": halfway,
    }
    rows = []
    for name, w in weights.items():
        figures = []
        for kind, preset in (("fp8", "FP8_DYNAMIC"), ("fp8_block", "FP8_BLOCK")):
            codes, scale = quantize_weight(w, kind)
            scheme = preset_name_to_scheme(preset, ["Linear"])
            figures.append(f"{sqnr_db(w, dequantize_weight(codes, scale, scheme)):.1f}")
        rows.append([name, *figures])
    return rows


def slicing(repeats: int = 3) -> tuple[float, float]:
    """Median seconds to quantize and measure one 8192 x 2048 weight (a Llama-3.2-1B MLP matrix)
    whole (the baseline) and a slice of rows at a time (hf_fp8.quantize_layer)."""
    import torch

    from nanochat.model.hf_fp8 import _scheme, dequantize_weight, quantize_layer, quantize_weight, sqnr_db

    w, scheme = torch.randn(8192, 2048, generator=torch.Generator().manual_seed(0)) * 0.02, _scheme("fp8")

    def whole():
        codes, scale = quantize_weight(w, "fp8", scheme)
        return sqnr_db(w, dequantize_weight(codes, scale, scheme))

    # the first round warms up
    runs = harness.interleave({"whole": lambda _: harness.timed(whole),
                               "sliced": lambda _: harness.timed(lambda: quantize_layer(w, "fp8", scheme))}, repeats + 1)
    med = harness.medians({name: times[1:] for name, times in runs.items()})
    return med["whole"], med["sliced"]


def large_exports(root: Path) -> list[list[str]]:
    """Size and time of the three exports of a Llama-3.2-1B-shaped model (tied embeddings)."""
    import torch

    from nanochat.model.export import export_hf
    from nanochat.model.gpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=128256, seq_len=8192, n_layer=16, n_head=32, n_kv_head=8, n_embd=2048,
                       intermediate_size=8192, tie_embeddings=True, mlp="swiglu", norm_weight=True, norm_eps=1e-5,
                       embed_norm=False, qk_norm=False, softcap=0.0, rope_theta=500000.0)
    with torch.device("meta"):
        model = GPT(config)
    model.materialize("cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.ndim > 1 else p.fill_(1.0)
    params, rows, base = model.num_params(), [], None
    for kind in KINDS:
        out = root / "large" / kind
        start = time.perf_counter()
        export_hf(model, None, out, quantize=kind)
        t = time.perf_counter() - start
        size = (out / "model.safetensors").stat().st_size
        base = base or (size, t)
        rows.append([kind if kind != "none" else "plain (fp32)", f"{size / 1e9:.2f} GB", f"{size / params:.2f}",
                     f"{size / base[0]:.3f}x", f"{t:.1f} s", f"{t / base[1]:.2f}x"])
        shutil.rmtree(out)
    return rows


def _logits(model, x: torch.Tensor) -> torch.Tensor:
    """[B, T, V] logits of nanochat's GPT or a transformers model."""
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def logits_of(model, prompts: list[list[int]]) -> torch.Tensor:
    """Logits over the validation prompts cut to one length: [prompts, T, V]."""
    import torch

    n = min(len(p) for p in prompts)
    with torch.no_grad():
        return _logits(model, torch.tensor([p[:n] for p in prompts])).float()


def fine_tuned(cfg: BenchExportConfig, root: Path) -> tuple[Path, Path, int]:
    """The example written to a fresh --work_dir and fine-tuned with emulated FP8: (data, run, steps)."""
    from nanochat.train.trainer import NanoChatTrainer

    if root.exists():
        if not (root / ".bench_export").is_file():
            raise UsageError(f"--work_dir {root} exists and was not made by bench_export; choose another")
        shutil.rmtree(root)
    root.mkdir(parents=True)
    (root / ".bench_export").write_text("")
    model_dir, data = build_example(root, cfg)
    run, steps = root / "run", cfg.steps
    NanoChatTrainer(model_name=str(model_dir), dataset_path=str(data), run_dir=str(run), fp8=True, fp8_emulate=True,
                    fp8_layers="all", fp8_min_dim=16, fp8_opt_level=2, num_iterations=steps, batch_size=8,
                    seq_len=128, lr=3e-3, warmup_steps=2, eval_every=0, num_samples=0, compile=False,
                    device="cpu").train()
    return data, run, steps


def timed_exports(model, tok, root: Path, repeats: int) -> dict[str, list[float]]:
    """Each kind exported `repeats` times to exports/<kind>-<i>, interleaved so that drift in the
    machine's load hits every kind alike; seconds per export."""
    from nanochat.model.export import export_hf

    def export(kind: str) -> Callable[[int], float]:
        return lambda i: harness.timed(lambda: export_hf(model, tok, root / "exports" / f"{kind}-{i}", quantize=kind))

    return harness.interleave({kind: export(kind) for kind in KINDS}, repeats)


def served_figures(dirs: dict[str, Path], data: Path, times: dict[str, list[float]], params: int) -> tuple[dict, int, int]:
    """Per kind: size, export time, weight and logit SQNR, accuracy as nanochat and transformers load it;
    and the counts of validation questions and logit prompts."""
    import torch
    import transformers

    from nanochat.data import instruct
    from nanochat.data.prepare import prepare_data
    from nanochat.model.hf import load_hf_model
    from nanochat.model.hf_fp8 import sqnr_db
    from nanochat.tokenizer import HFTokenizer
    from nanochat.train.evaluation import choice_counts

    tok, _ = instruct.choose_chat_template(HFTokenizer.load(dirs["none"]), None, records=True)
    store = prepare_data(data, tokenizer=tok, cache_root=cache_root()).store  # the run's, found in the cache
    items = instruct.choice_items(tok, list(store.val_records()))
    prompts = [it.prompt for it in items[:16]]
    hf = {k: transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for k, d in dirs.items()}
    ours = {k: load_hf_model(d)[0].eval() for k, d in dirs.items()}
    ref = logits_of(hf["none"], prompts)

    def accuracy(m) -> float:
        with torch.no_grad():
            correct, total = choice_counts(lambda x: _logits(m, x), items, batch_size=8, seq_len=128, device="cpu")
        return correct / total

    figures = {}
    export_s = harness.medians(times)
    time_vs_plain = harness.ratios(export_s, "none")
    plain_size = (dirs["none"] / "model.safetensors").stat().st_size
    for kind in KINDS:
        size, t = (dirs[kind] / "model.safetensors").stat().st_size, export_s[kind]
        report = json.loads((dirs[kind] / "fp8_report.json").read_text()) if kind != "none" else None
        sqnrs = [la["weight_sqnr_db"] for la in report["layers"] if la["stored_as"] == "fp8_e4m3"] if report else []
        figures[kind] = {
            "bytes": size, "bytes_per_param": size / params, "export_s_median": t,
            "export_time_vs_plain": time_vs_plain[kind], "size_vs_plain": size / plain_size,
            "fp8_layers": f"{len(sqnrs)}/{len(report['layers'])}" if report else "-",
            "weight_sqnr_db_min": min(sqnrs) if sqnrs else None,
            "logit_sqnr_db_served": sqnr_db(ref, logits_of(hf[kind], prompts)) if kind != "none" else None,
            "logit_sqnr_db_dequantized": sqnr_db(ref, logits_of(ours[kind], prompts)) if kind != "none" else None,
            "accuracy_nanochat": accuracy(ours[kind]), "accuracy_transformers": accuracy(hf[kind])}
    return figures, len(items), len(prompts)


def figure_rows(figures: dict) -> list[list[str]]:
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    return [[kind if kind != "none" else "plain (fp32)", f"{fig['bytes'] / 2**20:.2f} MiB",
             f"{fig['bytes_per_param']:.2f}", f"{fig['size_vs_plain']:.3f}x", f"{fig['export_s_median']:.2f} s",
             f"{fig['export_time_vs_plain']:.2f}x", fig["fp8_layers"], fmt(fig["weight_sqnr_db_min"], ".1f"),
             fmt(fig["logit_sqnr_db_served"], ".1f"), fmt(fig["logit_sqnr_db_dequantized"], ".1f"),
             f"{fig['accuracy_nanochat']:.3f}", f"{fig['accuracy_transformers']:.3f}"] for kind, fig in figures.items()]


def bench(cfg: BenchExportConfig) -> dict:
    import torch

    from nanochat.checkpoint import load_model, read_run
    from nanochat.model.hf_fp8 import require_compressed_tensors

    setup_logging()
    require_compressed_tensors("bench_export")
    root = Path(cfg.work_dir)
    data, run, steps = fine_tuned(cfg, root)
    model, tok = load_model(read_run(run))
    params, repeats = model.num_params(), cfg.repeats
    times = timed_exports(model, tok, root, repeats)
    figures, questions, prompts = served_figures({k: root / "exports" / f"{k}-0" for k in KINDS}, data, times, params)
    print(f"CPU ARC example: {params / 1e6:.2f}M parameters, {steps} steps of --fp8 --fp8_emulate, "
          f"{questions} validation questions, {prompts} prompts for the logits, median of {repeats} exports")
    print(format_table(["export", "model.safetensors", "B/param", "size vs plain", "export time", "vs plain",
                        "FP8 Linears", "min weight dB", "logit dB served", "logit dB dequant", "acc nanochat",
                        "acc transformers"], figure_rows(figures)))
    torch.manual_seed(0)
    dist = distribution_sqnr()
    print("\nweight SQNR (dB) of the FP8 copy of 1024 x 1024 weights; e4m3's worst case is 24.6 dB")
    print(format_table(["weights", "fp8 (per channel)", "fp8_block"], dist))
    whole, sliced = slicing()
    print(f"\none 8192 x 2048 weight quantized and measured: whole {whole * 1e3:.0f} ms, in slices of rows "
          f"{sliced * 1e3:.0f} ms ({whole / sliced:.2f}x faster)")
    large = large_exports(root) if cfg.large else []
    if large:
        print("\nLlama-3.2-1B shape (1.24B parameters, random weights), one export each")
        print(format_table(["export", "model.safetensors", "B/param", "size vs plain", "export time", "vs plain"],
                           large))
    return {"params": params, "steps": steps, "questions": questions, "figures": figures,
            "weight_sqnr_db": {r[0]: r[1:] for r in dist}, "slicing_s": {"whole": whole, "sliced": sliced},
            "large": large}


def main(argv: list[str] | None = None) -> int:
    return harness.main(BenchExportConfig, bench, argv, quick=QUICK)


if __name__ == "__main__":
    sys.exit(main())
