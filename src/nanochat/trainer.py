"""NanoChatTrainer: the training loop, evaluation, checkpoints, logging.

One object, one method: `NanoChatTrainer(**fields_of_TrainConfig).train() -> TrainResult`. The
CLI (`scripts/base_train.py`) builds the same `TrainConfig` from flags and calls the same code,
so anything the command line can do, Python can do with the same names.

Where to read what (methods of NanoChatTrainer, in file order):
  _setup          device, run directory (locked: one process per run), data (every data error
                  before a model exists), model (fp32 master weights; FP8 conversion before
                  compile), parallel wrapping, optimizer, compile, prechecks
  evaluate        validation loss and bits per byte; evaluate_accuracy: multiple choice; sample:
                  generation. All in high precision on the uncompiled model: the figure is the
                  model's quality, not FP8's inference noise
  _save, _resume  verified checkpoints (DCP directories when distributed); metrics.jsonl
  _train_step     one optimizer step: one device-to-host read in the steady state
  _train          the loop: step, time, evaluate, log, save; then _result builds TrainResult

FP8 is one component, `nanochat.fp8.FP8Training`, called at fixed points: after the model is
built (conversion), around each step's passes (calibration, statistics), after the backward
(non-finite check, clipping count) and after the optimizer step (auto's formats, re-checks).
Distributed runs (torchrun): docs/distributed.md. Mixed precision: bf16 autocast over fp32
master weights on CUDA, fp32 elsewhere unless --dtype says otherwise; --master_weights stores
weights and gradients in bf16 and --optimizer_in_backward frees the gradients (docs/master_weights.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from nanochat import checkpoint, distributed, engine, memory, mfu, runlock
from nanochat.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from nanochat.common import (
    NanoChatError,
    UsageError,
    format_bytes,
    format_table,
    host_read,
    logger,
    print0,
    resolve_device,
    resolve_dtype,
    seed_everything,
    setup_logging,
    write_atomic,
)
from nanochat.config import TrainConfig, flag_text
from nanochat import instruct
from nanochat.fp8 import FP8Training
from nanochat.fp8.master import param_dtype
from nanochat.fp8.optim import FP8Optim, optimizer_state_bytes, wrap_optimizer
from nanochat.fp8.tensor import FP8Tensor
from nanochat.guard import StepGuard
from nanochat.data import (
    TokenBatches, get_or_train_tokenizer, load_corpus, pack_records, tokenize_docs, tokenize_records, val_batches,
)
from nanochat.gpt import GPT, PRESETS, preset_config
from nanochat.evaluation import choice_counts, describe_scoring
from nanochat.hf import HFTokenizer, gpt_config_from_hf, load_hf_model, resolve_model
from nanochat.tokenizer import Tokenizer

# Fields that must match between a checkpoint and a --resume run: they change the model, the
# data stream or the optimizer's meaning. Everything else (num_iterations, eval_every, ...) may
# differ, so a run can be extended.
# batch_size is not among them: it is checked as the global batch (batch_size x world size), so a
# run saved by 2 ranks of 8 sequences resumes in 1 process of 16 or 4 of 4.
_RESUME_MUST_MATCH = (
    "model_name", "dataset_path", "tokenizer_dir", "vocab_size", "seq_len",
    "grad_accum_steps", "seed", "fp8", "fp8_mode", "fp8_recipe", "fp8_layers", "fp8_opt_level", "fp8_skip",
    "fp8_min_dim", "master_weights", "master_weights_emulate", "init_from",
)
# what a checkpoint written before a field existed trained with (before --fp8_layers, FP8 converted
# every eligible layer)
_RESUME_DEFAULTS = {"master_weights": "fp32", "master_weights_emulate": False, "init_from": None,
                    "fp8_layers": "all"}
# What a checkpoint must hold to be resumed, or to start another run from (dotted: nested), besides
# the tensors: a .pt's "model", "optimizer" and "rng", which a DCP step holds outside its trainer.json.
_RESUME_KEYS = ("config.batch_size", "step", "data", "tokenizer_fingerprint")
_INIT_KEYS = ("config.model_name", "step", "tokenizer_fingerprint")


@dataclass
class TrainResult:
    """What a run produced; also written to `<run_dir>/result.json`."""

    train_loss: float
    """Mean training loss over the last logged steps (nats per token)."""
    val_loss: float
    """Validation loss at the end (nats per token, high precision)."""
    val_bpb: float
    """Validation bits per byte at the end: comparable across tokenizers (8 = uniform bytes)."""
    tokens_per_sec: float
    """Training throughput over the steady-state steps: the steps that compiled (see
    compile_time_s) and auto's eager calibration steps are excluded."""
    steps: int
    """Optimizer steps completed (including those done before a --resume)."""
    epochs: float
    """Passes over the training tokens completed."""
    wall_time_s: float
    """Seconds this call of train() took, setup included."""
    compile_time_s: float = 0.0
    """Wall time of the steps that compiled the model (the first step, and the first after auto's
    calibration): tracing and code generation plus that step's own work. 0 without --compile."""
    fallbacks: list[str] = field(default_factory=list)
    """Every fallback the run took, with its reason (e.g. no FP8 hardware)."""
    optimizer_state_bytes: int = 0
    """Bytes of optimizer state (Adam moments and FP8 block scales)."""
    num_params: int = 0
    fp8_backend: str = "off"
    """off, native, emulated or fallback."""
    fp8_converted: list[str] = field(default_factory=list)
    fp8_skipped: dict[str, str] = field(default_factory=dict)
    fp8_decisions: dict[str, str] = field(default_factory=dict)
    """--fp8_layers: layer -> why it was converted or kept in bf16 (the measured fwd+bwd ratio,
    or the rule that decided)."""
    fp8_measure_time_s: float = 0.0
    """--fp8_layers faster: seconds spent timing layer shapes on the GPU before training (0 when
    every shape came from the cache); part of wall_time_s, not of compile_time_s."""
    fp8_choices: dict[str, dict[str, str]] | None = None
    """--fp8_mode auto: layer -> role -> chosen dtype name."""
    fp8_stats: dict[str, Any] | None = None
    samples: list[str] = field(default_factory=list)
    run_dir: str = ""
    parallel: str = "none"
    """How the run was spread over processes: none, or ddp/fsdp x world size (backend), with FP8
    all-gather on/off and why."""
    val_accuracy: float | None = None
    """Multiple-choice accuracy on the validation records at the end: the prediction is the option
    whose answer tokens have the highest log-likelihood (nanochat.evaluation); None when there are
    no multiple-choice records."""
    accuracy_scoring: str | None = None
    """How val_accuracy scored the options: "option log-likelihood (1 token per option)", which is
    the letters' logits compared, or e.g. "(1-2 tokens per option)" where some letter takes two
    tokens. None without multiple-choice records."""
    state_bytes_per_param: float = 0.0
    """Training state per parameter, measured from the live tensors after the first optimizer
    step: weights + gradients (all of them before the step; the largest one alive at a time with
    --optimizer_in_backward) + optimizer states (moments, FP8 scales, bf16_split's remainders),
    divided by the parameters (this rank's under FSDP). Breakdown in state_bytes."""
    state_bytes: dict[str, int] = field(default_factory=dict)
    """The bytes behind state_bytes_per_param: weights, gradients, optimizer."""
    planned_memory_bytes: int = 0
    """The memory plan's total per device (an estimate, printed before the weights were loaded)."""
    peak_memory_bytes: int | None = None
    """Measured peak of allocated memory on CUDA (torch.cuda.max_memory_allocated); None elsewhere."""
    flops_per_token: int = 0
    """Model FLOPs per trained token: GPT.flops_per_token at --seq_len (nanochat.mfu)."""
    peak_tflops: float | None = None
    """The dense bf16 peak per GPU that `mfu` divides by, from the device's datasheet
    (nanochat.mfu.PEAKS); None without a listed peak (CPU, MPS, an unlisted GPU)."""
    mfu: float | None = None
    """Model FLOPs utilization against the dense bf16 peak: tokens_per_sec x flops_per_token /
    (GPUs x peak_tflops). One denominator for bf16 and FP8 runs, so MFUs compare as tokens/s
    do. None where the peak is unknown."""
    mfu_fp8: float | None = None
    """The same against the dense FP8 peak, for runs with native FP8 layers (a lower bound on
    the FP8 tensor cores' use: the head and attention stay in bf16); None otherwise."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _jsonable(x: Any) -> Any:
    """`x` with every non-finite float as None: metrics.jsonl and result.json are strict JSON
    (json.dumps would write NaN, which only Python's parser reads); the field names stay."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def _json_line(record: dict[str, Any]) -> str:
    return json.dumps(_jsonable(record), allow_nan=False) + "\n"


def _is_compile_failure(e: BaseException) -> bool:
    """An exception raised by torch.compile's machinery (dynamo, inductor, a C++ or Triton
    toolchain), as opposed to an error of the model or the data that eager would raise too."""
    from torch._dynamo.exc import BackendCompilerFailed, TorchDynamoException

    if isinstance(e, (BackendCompilerFailed, TorchDynamoException)):
        return True
    mod = type(e).__module__ or ""
    return mod.startswith(("torch._dynamo", "torch._inductor", "triton"))


def lr_multiplier(step: int, total_steps: int, warmup_steps: int, final_lr_frac: float) -> float:
    """Linear warmup to 1, then cosine decay to `final_lr_frac` at the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return final_lr_frac + (1 - final_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress))


class NanoChatTrainer:
    """Train a GPT. `NanoChatTrainer(model_name="d4", fp8=True, fp8_mode="e5m2").train()`."""

    # What a run is made of, set by _setup (declared here so each has one name to grep for).
    model: GPT
    """The model: what is saved, evaluated and sampled (FP8 layers converted in place)."""
    dist_model: torch.nn.Module
    """`model` wrapped for the world size (DDP), or `model` itself; eager steps call it."""
    compiled: torch.nn.Module
    """`dist_model` compiled (or with its blocks compiled in place); compiled steps call it."""
    fp8: FP8Training
    """FP8's side of the loop (conversion, calibration, statistics, non-finite steps, counters)."""
    fp8_all_gather_problem: str | None
    """Under FSDP with FP8: why weights do not all-gather in FP8 (None: they do, or no FSDP)."""
    optimizer: torch.optim.Optimizer
    tokenizer: Tokenizer | HFTokenizer
    loader: TokenBatches
    """The training batches (its position is checkpointed)."""
    train_tokens: torch.Tensor
    val_tokens: torch.Tensor
    train_mask: torch.Tensor | None
    """Instruction data: True where a target token is scored; None for plain text."""
    val_mask: torch.Tensor | None
    fallbacks: list[str]
    """Every fallback the run took, with its reason (TrainResult.fallbacks)."""
    flops_per_token: int
    """Model FLOPs per trained token (TrainResult.flops_per_token)."""
    peak: mfu.Peak | None
    """This device's dense tensor-core peaks, None if not listed: MFU is reported against them."""
    _locked: Path | None = None
    """The run directory whose lock this trainer holds (rank 0), released when train() ends."""

    def __init__(self, config: TrainConfig | None = None, **kwargs: Any):
        if config is not None and kwargs:
            raise TypeError("pass either a TrainConfig or keyword fields, not both")
        if config is None:
            names = {f.name for f in dataclasses.fields(TrainConfig)}
            unknown = sorted(set(kwargs) - names)
            if unknown:
                raise TypeError(
                    f"unknown NanoChatTrainer field(s) {unknown}; the fields are those of "
                    f"TrainConfig (the CLI flags): {sorted(names)}"
                )
            config = TrainConfig(**kwargs)
        self.config = config

    # ------------------------------------------------------------------ setup
    def _fallback(self, message: str) -> None:
        """Record a fallback in the run's results and say it once, now."""
        self.fallbacks.append(message)
        logger.warning("WARNING: %s", message)

    def _setup(self) -> None:
        """Everything before the first step, in the order that makes errors come early: device,
        run directory, data (every data error before a model exists), model (FP8 conversion
        before compile), parallel wrapping, optimizer, compile, prechecks."""
        cfg = self.config
        setup_logging()
        self.dist, self.device = distributed.init_distributed(resolve_device(cfg.device))
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        # (--fp8_skip '*': no FP8 layer, only the FP8 optimizer states, which any dtype can use)
        if cfg.fp8 and self.dtype != torch.float32 and self.device.type != "cuda" and "*" not in cfg.fp8_skip:
            raise UsageError(
                f"--fp8 with --dtype {cfg.dtype} on {self.device.type}: torchao's FP8 layers only "
                "support bf16 autocast on CUDA (elsewhere they would round outputs to the wrong dtype). "
                "Use --dtype float32 (the default off CUDA) with --fp8."
            )
        self.run_dir = Path(cfg.run_dir)
        self._check_run_dir()
        self.fallbacks: list[str] = []
        self.state_bytes: dict[str, int] = {}
        self.cache_root = Path(os.environ.get("NANOCHAT_CACHE", ".cache"))
        seed_everything(cfg.seed)
        self._setup_data()
        self._setup_model()
        self.dist_model = self._parallelize()  # before the optimizer: FSDP replaces the parameters
        self._setup_optimizer()
        self._compile()
        # the two factors of MFU (nanochat.mfu): the model's FLOPs per token, the device's peaks
        self.flops_per_token = self.model.flops_per_token(cfg.seq_len)
        self.peak = mfu.device_peak(self.device)
        self.autocast = (
            torch.autocast(self.device.type, dtype=self.dtype)
            if self.dtype != torch.float32 else contextlib.nullcontext()
        )
        self._prechecks()

    def _setup_data(self) -> None:
        """Corpus, tokenizer (a Hugging Face model brings its own, a preset uses ours), token
        streams, multiple-choice items and the batch loader."""
        cfg = self.config
        self.resolved = resolve_model(cfg.model_name)
        self.corpus = load_corpus(cfg.dataset_path)
        logger.info("corpus: %s", self.corpus.describe())
        self.init_source = None
        if cfg.init_from is not None and cfg.resume:  # the tokenizer this run started with (the source may be gone)
            self.tokenizer = Tokenizer.load(self.run_dir / "tokenizer")
        elif cfg.init_from is not None:
            self.init_source = self._read_init_source()
            self.tokenizer = self.init_source["tokenizer"]
        elif self.resolved.kind == "hf":
            if cfg.tokenizer_dir:
                raise ValueError(
                    f"--tokenizer_dir cannot be combined with the Hugging Face model {cfg.model_name!r}: "
                    "its own tokenizer (in the checkpoint directory) is the one its embeddings know"
                )
            self.tokenizer = HFTokenizer.load(self.resolved.path)
        elif cfg.tokenizer_dir:
            self.tokenizer = Tokenizer.load(cfg.tokenizer_dir)
        else:
            self.tokenizer = get_or_train_tokenizer(
                self.corpus, cfg.vocab_size, cache_root=self.cache_root / "tokenizers"
            )
            if self.tokenizer.vocab_size < cfg.vocab_size:
                self._fallback(
                    f"tokenizer: the corpus ran out of BPE merges at {self.tokenizer.vocab_size} tokens "
                    f"(--vocab_size {cfg.vocab_size} asked); training with the smaller vocabulary"
                )
        # A base model has no chat template: records are rendered in the plain format instead.
        self.tokenizer, template_fallback = instruct.choose_chat_template(
            self.tokenizer, cfg.chat_template, records=self.corpus.kind == "instruct")
        if template_fallback:
            self._fallback(template_fallback)
        if self.corpus.kind == "instruct":  # loss on the assistant tokens only
            self.train_tokens, self.train_mask = self._pack("train", self.corpus.train_records, self.corpus.train_ids)
            self.val_tokens, self.val_mask = self._pack("val", self.corpus.val_records, self.corpus.val_ids)
        else:
            token_cache = self.cache_root / "tokens"
            self.train_tokens = tokenize_docs(self.tokenizer, self.corpus.train_docs, cache_dir=token_cache)
            self.val_tokens = tokenize_docs(self.tokenizer, self.corpus.val_docs, cache_dir=token_cache)
            self.train_mask = self.val_mask = None
        # multiple-choice validation records, this rank's share: accuracy at every evaluation
        items = (instruct.choice_items(self.tokenizer, self.corpus.val_records, cfg.eval_tokens)
                 if self.corpus.kind == "instruct" else [])
        self.num_choice_items = len(items)
        self.choice_items = items[self.dist.rank::self.dist.world_size]
        self.accuracy_scoring = describe_scoring(items) if items else None
        self.token_bytes = self.tokenizer.token_bytes().to(self.device)
        self.loader = TokenBatches(
            self.train_tokens, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed,
            rank=self.dist.rank, world_size=self.dist.world_size, loss_mask=self.train_mask,
        )
        self.steps_per_epoch = self.loader.steps_per_epoch // cfg.grad_accum_steps
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"one optimizer step needs {cfg.grad_accum_steps} batches but an epoch has only "
                f"{self.loader.steps_per_epoch}; lower --grad_accum_steps or --batch_size"
            )
        self.total_steps = cfg.num_iterations if cfg.num_iterations > 0 else cfg.num_epochs * self.steps_per_epoch
        if cfg.resume:
            self._check_resume_target()

    def _check_resume_target(self) -> None:
        """--resume with the newest checkpoint at or past the last step trains nothing: refused
        before any work (a finished run, or --num_iterations below its step), so result.json is
        never rewritten with nothing measured. A run killed after its final checkpoint, before
        its result.json, does resume: it finishes (final evaluation, result)."""
        cfg, d = self.config, self.run_dir
        _, path, step = self._find_checkpoint(d, "--resume")
        more = f"pass a larger --num_iterations (more than {step}) to train on"
        if step > self.total_steps:
            budget = (f"--num_iterations {cfg.num_iterations}" if cfg.num_iterations > 0
                      else f"--num_epochs {cfg.num_epochs} ({self.total_steps} steps)")
            raise UsageError(f"--resume: {d} is already at step {step} ({path.name}); {budget} would train "
                             f"nothing: {more}")
        if step == self.total_steps:
            try:
                finished = json.loads((d / "result.json").read_text()).get("steps") == step
            except (OSError, ValueError, AttributeError):
                finished = False
            if finished:
                raise UsageError(f"--resume: the run in {d} already finished at step {step} (its result.json); "
                                 f"{more}, or start it over with --overwrite")

    def _read_init_source(self) -> dict[str, Any]:
        """--init_from: the source run's newest checkpoint (.pt or DCP), verified, and its tokenizer,
        checked against this run before any weight is read: a preset of the same name, the same
        tokenizer it trained with. A .pt checkpoint is memory-mapped: only the weights are read."""
        cfg = self.config
        src = Path(cfg.init_from)
        if not src.is_dir():
            raise UsageError(f"--init_from {src}: no such directory; give the --run_dir of a finished run")
        found = self._find_checkpoint(src, "--init_from")
        if found is None:
            raise UsageError(f"--init_from {src}: no checkpoint there (no checkpoint-<step>.pt with its .json "
                             f"manifest, no {distributed.DCP_DIRNAME}/); give the --run_dir of a run that saved one")
        kind, path, _ = found
        meta = self._read_meta(kind, path, "--init_from", _INIT_KEYS)
        weights = meta["model"] if kind == "pt" else None
        name = meta["config"]["model_name"]
        if name not in PRESETS:
            raise UsageError(f"--init_from {src} trained the Hugging Face model {name}: continue from its export "
                             f"(python scripts/export_hf.py --run_dir {src} --out_dir <dir>, then --model_name <dir>)")
        if name != cfg.model_name:
            raise UsageError(f"--init_from {src} holds a {name} model, --model_name is {cfg.model_name}: "
                             f"pass --model_name {name}")
        if not (src / "tokenizer").is_dir():
            raise UsageError(f"--init_from {src}: its tokenizer/ directory is missing, and the weights only mean "
                             "something with the tokenizer they were trained with; restore it from the run")
        tokenizer = Tokenizer.load(src / "tokenizer")
        if tokenizer.fingerprint != meta["tokenizer_fingerprint"]:
            raise UsageError(f"--init_from {src}: {src / 'tokenizer'} is not the tokenizer its checkpoint was "
                             "trained with (fingerprints differ); restore the run's own tokenizer/")
        return {"kind": kind, "path": path, "step": int(meta["step"]), "weights": weights, "tokenizer": tokenizer}

    def _pack(self, split: str, records: list, ids: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Instruction records laid out whole inside the seq_len+1 windows (data.pack_records):
        tokens and loss mask of one split."""
        cfg = self.config
        tokens, mask, starts = tokenize_records(self.tokenizer, records, cache_dir=self.cache_root / "tokens",
                                                ids=ids, with_starts=True)
        tokens, mask, packing = pack_records(tokens, mask, starts, cfg.seq_len, self.tokenizer.bos_id)
        logger.info("%s records: %d packed into windows of %d tokens, %.1f%% padding", split,
                    packing.records, cfg.seq_len + 1, packing.pad_pct)
        if packing.long_records:
            self._fallback(
                f"instruction data: {packing.long_records} of {packing.records} {split} records are "
                f"longer than a window (--seq_len {cfg.seq_len} + 1 tokens); their tokens past the "
                "first window are trained without the record's beginning. Raise --seq_len to keep "
                "them whole")
        return tokens, mask

    def _setup_model(self) -> None:
        """The memory plan first (a run that cannot fit fails before a weight is allocated), then
        the model in fp32 master weights, then FP8 conversion (before compile)."""
        cfg = self.config
        if self.resolved.kind == "hf":
            hf_json = json.loads((self.resolved.path / "config.json").read_text())
            model_config = gpt_config_from_hf(hf_json, seq_len=cfg.seq_len)
        else:
            model_config = preset_config(cfg.model_name, vocab_size=self.tokenizer.vocab_size, seq_len=cfg.seq_len)
        sharded = self.dist.is_distributed and cfg.fsdp
        self.param_dtype = torch.float32 if cfg.master_weights_emulate else param_dtype(cfg.master_weights)
        self.memory_plan = memory.plan_training(
            model_config, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
            opt_level=cfg.fp8_opt_level if cfg.fp8 else 0, activation_checkpointing=cfg.activation_checkpointing,
            master_weights="fp32" if cfg.master_weights_emulate else cfg.master_weights,
            optimizer_in_backward=cfg.optimizer_in_backward,
            autocast=self.dtype != torch.float32, shards=self.dist.world_size if sharded else 1,
            free_bytes=memory.free_bytes(self.device))
        print0(self.memory_plan.table())
        self.memory_plan.check(fp8=cfg.fp8)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.resolved.kind == "hf":
            # Built on the meta device and filled from memory-mapped safetensors: no 2x memory.
            self.model, _ = load_hf_model(self.resolved.path, self.device, self.param_dtype, seq_len=cfg.seq_len)
        else:
            self.model = GPT(model_config).to(self.device)
            self.model.init_weights()
            if self.init_source is not None:
                self._load_init_weights()
        if cfg.master_weights != "fp32":  # parameters only: the rotary tables stay fp32
            for p in self.model.parameters():  # emulated: fp32 tensors holding the bf16 values
                p.data = p.data.to(torch.bfloat16).to(self.param_dtype)
        self.model.activation_checkpointing = cfg.activation_checkpointing
        # the M of every Linear's GEMMs, at which --fp8_layers faster times the layers
        fp8_config = dataclasses.replace(cfg.fp8_config(), micro_batch_tokens=cfg.batch_size * cfg.seq_len)
        self.fp8_all_gather_problem = None
        if cfg.fp8 and cfg.fsdp and self.dist.is_distributed:
            # decided before converting: torchao wraps the weights for FSDP2's FP8 all-gather then
            self.fp8_all_gather_problem = distributed.fp8_all_gather_problem(self.model, fp8_config, fsdp=True)
            fp8_config = dataclasses.replace(fp8_config, fsdp_float8_all_gather=self.fp8_all_gather_problem is None)
        self.fp8 = FP8Training(self.model, fp8_config)
        self.guard = StepGuard(self.model, max_overflows=cfg.fp8_max_overflows, counters=self.fp8.counters)
        if self.device.type == "cuda" and self.fp8.report is not None and self.fp8.report.shapes_measured:
            torch.cuda.reset_peak_memory_stats(self.device)  # the timing buffers are gone: not the run's peak

    @torch.no_grad()
    def _load_init_weights(self) -> None:
        """The --init_from source's weights into the freshly built model (before the master-weight
        cast and FP8 conversion, which then treat them as any initial weights)."""
        src = self.init_source
        try:
            if src["kind"] == "dcp":
                distributed.load_dcp_model(src["path"], self.model)
            else:
                self.model.load_state_dict(src["weights"])
        except (RuntimeError, KeyError) as e:
            raise UsageError(f"--init_from {self.config.init_from}: its weights do not fit this {self.config.model_name} "
                             f"model ({str(e).splitlines()[0]}); it was saved by another version of the model") from None
        src["weights"] = None  # the memory-mapped checkpoint is closed with its last reference
        bad = [n for n, p in self.model.named_parameters() if not torch.isfinite(p).all()]
        if bad:
            raise NanoChatError(f"--init_from {self.config.init_from}: its checkpoint {src['path']} holds inf/nan in "
                                f"{', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}; start from one of its earlier "
                                "checkpoints (move this one away)")
        logger.info("initialized from %s (step %d of that run)", src["path"], src["step"])

    def _setup_optimizer(self) -> None:
        """AdamW, no weight decay on embeddings / norms / biases; FP8Optim around it with --fp8."""
        cfg = self.config
        adamw = torch.optim.AdamW(
            self.model.param_groups(cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
            # fused: one kernel for all parameters (CPU and CUDA); FP8Optim steps its FP8-state
            # parameters itself and hands the rest to this same optimizer, so baselines match.
            eps=1e-8, fused=self.device.type in ("cpu", "cuda"),
        )
        for group in adamw.param_groups:
            group["initial_lr"] = cfg.lr
        self.optimizer = wrap_optimizer(adamw, opt_level=cfg.fp8_opt_level if cfg.fp8 else 0,
                                        master_weights=cfg.master_weights, seed=cfg.seed,
                                        emulate=cfg.master_weights_emulate, in_backward=cfg.optimizer_in_backward)
        if cfg.optimizer_in_backward:
            if self.dist.is_distributed:
                raise UsageError(f"--optimizer_in_backward under torchrun ({self.parallel}): DDP and FSDP reduce "
                                 "gradients after the per-parameter steps would have run; train in one process or "
                                 "drop --optimizer_in_backward")
            self.optimizer.step_in_backward()
        # this rank's; before the first step: what that step will allocate
        self.optimizer_state_bytes = optimizer_state_bytes(self.optimizer)

    def _check_run_dir(self) -> None:
        """Before any work: --run_dir is a directory, or can become one; one that exists is locked
        now (_lock_run_dir), and a run already in it is continued (--resume) or replaced
        (--overwrite), never silently clobbered. One that does not exist yet is created and locked
        by _prepare_run_dir, so that an error in the data or the model leaves nothing behind."""
        d = self.run_dir
        if d.exists() and not d.is_dir():
            raise UsageError(f"--run_dir {d} exists and is not a directory; give a directory path")
        if d.is_dir():
            self._lock_run_dir()
        distributed.barrier()  # the other ranks look at what rank 0 finished or removed
        self._refuse_clobbering()

    def _lock_run_dir(self) -> None:
        """Rank 0 (the other ranks share the directory): take --run_dir's lock, held until train()
        returns, then finish or remove what a killed save left there and report what is not
        provably nanochat's (runlock.py says why the lock makes that a proof)."""
        if self.dist.rank != 0:
            return
        try:
            runlock.acquire(self.run_dir)
        except OSError as e:
            raise UsageError(f"--run_dir {self.run_dir} is not writable ({e.strerror or e}); fix its permissions or "
                             "choose another --run_dir") from None
        self._locked = self.run_dir
        for note in checkpoint.clean_interrupted(self.run_dir) + distributed.clean_interrupted_dcp(self.run_dir):
            logger.info("%s", note)

    def _refuse_clobbering(self) -> None:
        """--resume needs a checkpoint; a fresh start needs a directory without a run, or
        --overwrite and only checkpoints nanochat can tell it wrote (the only ones it deletes)."""
        cfg, d = self.config, self.run_dir
        existing = checkpoint.run_contents(d)
        if cfg.resume:
            if self._find_checkpoint(d, "--resume") is None:
                legacy = (f" Its checkpoint.pt was written by an earlier nanochat, without the checksum "
                          "--resume verifies: it still loads with torch.load(weights_only=True), but "
                          "cannot be resumed." if (d / "checkpoint.pt").is_file() else "")
                raise UsageError(
                    f"--resume: no checkpoint in {d} (no checkpoint-<step>.pt with its .json manifest, no "
                    f"{distributed.DCP_DIRNAME}/).{legacy} Start a fresh run without --resume, or point "
                    "--run_dir at the directory of the run you want to continue.")
        elif existing and not cfg.overwrite:
            raise UsageError(
                f"--run_dir {d} already holds a run ({', '.join(existing[:4])}); continue it with --resume, "
                "replace it with --overwrite (deletes its checkpoints and metrics), or choose a new --run_dir")
        elif existing:
            foreign = checkpoint.foreign_checkpoints(d) + distributed.foreign_dcp(d)
            if foreign:
                raise UsageError(
                    f"--overwrite: {d} holds checkpoints nanochat cannot tell it wrote ({'; '.join(foreign[:3])}), "
                    "and it deletes only its own; move them out of the directory and run again")

    def _prepare_run_dir(self) -> None:
        """Create --run_dir and prove it writable (every rank probes, since each writes there);
        rank 0 locks a directory created just now and looks at it again (another process may
        have started there meanwhile), and makes room for --overwrite: it deletes the previous
        run's checkpoints that their manifests describe (_refuse_clobbering refused any other)
        and its metrics, with no barrier: the other ranks only write there later."""
        d = self.run_dir
        try:
            d.mkdir(parents=True, exist_ok=True)
            probe = d / f".write-probe-{os.getpid()}-{self.dist.rank}"
            probe.write_bytes(b"nanochat")
            probe.unlink()
        except OSError as e:
            raise UsageError(f"--run_dir {d} is not writable ({e.strerror or e}); fix its permissions or "
                             "choose another --run_dir") from None
        if self.dist.rank != 0:
            return
        if self._locked is None:
            self._lock_run_dir()
            self._refuse_clobbering()
        if self.config.overwrite and checkpoint.run_contents(d):
            logger.info("--overwrite: deleting the previous run's checkpoints and metrics in %s", d)
            checkpoint.remove_checkpoints(d)
            distributed.remove_dcp(d)
            for name in checkpoint.RUN_FILES:
                (d / name).unlink(missing_ok=True)

    def _prechecks(self) -> None:
        """Everything that would otherwise fail after training has started, checked now."""
        cfg = self.config
        # one evaluation window (val_batches raises the data error, naming the fix)
        next(iter(val_batches(self.val_tokens, cfg.seq_len, cfg.batch_size, cfg.eval_tokens,
                              rank=self.dist.rank, world_size=self.dist.world_size,
                              loss_mask=self.val_mask)), None)
        if cfg.num_samples and self.corpus.kind == "instruct":
            for r in self.corpus.val_records[:cfg.num_samples]:
                instruct.generation_prompt(self.tokenizer, r)
        self._prepare_run_dir()
        if not cfg.save_checkpoints:
            return
        # room for one more checkpoint: the new one is complete before older ones are deleted
        need = sum(distributed.local_numel(t) * t.element_size() for t in self.model.state_dict().values()
                   if isinstance(t, torch.Tensor)) + self.optimizer_state_bytes
        free = shutil.disk_usage(self.run_dir).free
        if free < need:
            raise NanoChatError(
                f"--run_dir {self.run_dir}: {format_bytes(free)} free on its disk, one checkpoint needs about "
                f"{format_bytes(need)}; free space or choose a --run_dir on another disk")

    def _parallelize(self) -> torch.nn.Module:
        """Wrap the model for this world size; returns the module the training step calls (DDP
        around self.model, or self.model itself: one process, or sharded in place by FSDP)."""
        cfg = self.config
        self.parallel = "none"
        if not self.dist.is_distributed:
            if cfg.fsdp:
                self._fallback("fsdp: --fsdp ignored in a single process (launch with torchrun "
                               "--nproc_per_node=N to shard)")
            return self.model
        kind = "fsdp" if cfg.fsdp else "ddp"
        self.parallel = f"{kind} x{self.dist.world_size} ({distributed.backend_name()})"
        if cfg.fsdp and self.fp8.has_fp8_layers:
            if self.fp8.config.fsdp_float8_all_gather:
                n = len(self.fp8.report.converted)
                self.parallel += (f", fp8 all-gather on ({n} layers' weights all-gathered in "
                                  f"{cfg.fp8_mode}, scales precomputed after each optimizer step)")
            else:
                self.parallel += f", fp8 all-gather off: {self.fp8_all_gather_problem}"
        return distributed.wrap_model(self.model, fsdp=cfg.fsdp, device=self.device,
                                      blocks=self.model.transformer.h)

    def _compile(self) -> None:
        """Set `compiled`, the module a compiled training step calls: `dist_model` compiled whole, or
        with each transformer block compiled in place (one graph that every block reuses).
        Compilation itself happens in the first step that runs it (`_compile_pending`)."""
        cfg = self.config
        self.compiled = self.dist_model
        self._compiled_in_place = False
        self._compile_pending = False
        self._eager_only = False
        self.compile_time_s = 0.0
        if not cfg.compile:
            return
        if cfg.compile_scope == "blocks":
            for block in self.model.transformer.h:
                block.compile()
            self._compiled_in_place = True
        else:
            self.compiled = torch.compile(self.dist_model)
        self._compile_pending = True

    def _uncompile(self) -> None:
        self.compiled = self.dist_model
        self._compile_pending = False
        self._eager_only = True  # blocks compiled in place stay so; every forward forces eager

    def _eager(self):
        """Run compiled code eagerly: blocks compiled in place when a step must be eager (FP8
        statistics and calibration hooks, evaluation, sampling)."""
        if self._compiled_in_place:
            return torch.compiler.set_stance("force_eager")
        return contextlib.nullcontext()

    def _print_header(self) -> None:
        cfg, m = self.config, self.model
        n_params = m.num_params()
        n_local = sum(distributed.local_numel(p) for p in m.parameters())  # this rank's (FSDP shard)
        rows = [
            ["model", f"{cfg.model_name}: {m.config.n_layer} layers, width {m.config.n_embd}, "
                      f"{m.config.n_head} heads ({m.config.n_kv_head} kv), {n_params / 1e6:.2f}M params"],
            *([["init", f"weights of {self.init_source['path']} (step {self.init_source['step']})"]]
              if self.init_source is not None else []),
            ["data", f"{self.corpus.describe()}"],
            ["tokens", f"{len(self.train_tokens):,} train / {len(self.val_tokens):,} val, "
                       f"vocab {self.tokenizer.vocab_size}"],
            ["schedule", f"{self.total_steps} steps x {cfg.batch_size * cfg.grad_accum_steps * self.dist.world_size}"
                         f" x {cfg.seq_len} tokens ({self.steps_per_epoch} steps/epoch)"],
            ["device", f"{self.device} ({self.dtype}), world size {self.dist.world_size}, "
                       f"compile {(cfg.compile_scope if cfg.compile else 'off')}"],
            ["parallel", self.parallel],
            ["optimizer", f"AdamW, {format_bytes(self.optimizer_state_bytes)} of state"
                          f"{' on each rank' if self.dist.is_distributed else ''} "
                          f"({self.optimizer_state_bytes / n_local:.3f} bytes/param)"],
        ]
        if not cfg.save_checkpoints:
            rows.append(["checkpoints", "none (--no_save_checkpoints): this run cannot be resumed or exported"])
        if self.fp8.report is not None:
            rows.append(["fp8", flag_text(self.fp8.report.summary())])
        if self.peak is not None:
            against = f"the {self.peak.part}'s dense bf16 peak, {self.peak.bf16_tflops:g} TFLOP/s ({self.peak.source})"
        else:
            name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else self.device.type
            against = f"no listed peak for {name}: MFU not reported"
        rows.append(["mfu", f"{self.flops_per_token / 1e9:.3g} GFLOP per token, against {against}"])
        print0(format_table(["run", ""], rows))
        if self.fp8.report is not None:
            print0(self.fp8.report.table(flag_text))
            if cfg.fp8_opt_level:
                print0(self.optimizer.summary())
            print0("fp8: evaluation and sampling run in high precision ("
                   + ("an unsharded copy of the FSDP shards)" if self.dist.is_distributed and cfg.fsdp
                      else "fp8_disabled)"))

    # --------------------------------------------------------------- evaluate
    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """Validation loss (nats/token) and bits per byte, in high precision, uncompiled.

        Distributed: each rank scores its share of the windows and the sums are all-reduced."""
        cfg = self.config
        # [nats, scored tokens, bytes] summed over this rank's windows
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        with self._eval_model() as model, self.autocast:
            for x, y in val_batches(self.val_tokens, cfg.seq_len, cfg.batch_size, cfg.eval_tokens,
                                    rank=self.dist.rank, world_size=self.dist.world_size,
                                    loss_mask=self.val_mask):
                x, y = x.to(self.device), y.to(self.device)
                loss = model(x, y, reduction="none").view(-1).double()
                y = y.view(-1)
                scored = y >= 0  # -1: a position the loss mask excludes (instruction prompts)
                nbytes = self.token_bytes[y.clamp(min=0)] * scored
                # text: special tokens (BOS) carry no bytes and are not scored; records: every scored
                # target counts, the closing <|end|>/eos included (stopping is part of the answer)
                counted = scored if self.val_mask is not None else nbytes > 0
                totals[0] += torch.where(counted, loss, 0.0).sum()
                totals[1] += counted.sum()
                totals[2] += nbytes.sum()
        total_nats, total_tokens, total_bytes = distributed.all_reduce_sum(totals).tolist()
        if total_tokens == 0:
            raise ValueError("validation split has no scorable tokens; use a larger --dataset_path")
        return total_nats / total_tokens, total_nats / (math.log(2) * total_bytes)

    @torch.no_grad()
    def evaluate_accuracy(self) -> float | None:
        """Multiple-choice accuracy on the validation records (nanochat.evaluation), in high
        precision, uncompiled; None without multiple-choice records. Ranks score their shares."""
        if not self.num_choice_items:
            return None
        with self._eval_model() as model:
            correct, total = choice_counts(model, self.choice_items, batch_size=self.config.batch_size,
                                           seq_len=self.config.seq_len, device=self.device, autocast=self.autocast)
        counts = distributed.all_reduce_sum(torch.tensor([correct, total], dtype=torch.float64, device=self.device))
        correct, total = counts.tolist()
        return correct / total

    @contextlib.contextmanager
    def _eval_model(self):
        """The model in eval mode and high precision, for evaluation and sampling.

        One process and DDP: self.model itself (unwrapped, so no collectives) inside
        fp8_disabled. FSDP: a plain, unsharded high-precision copy gathered from the shards
        (collective: every rank enters); see distributed.py for why.
        """
        if self.dist.is_distributed and self.config.fsdp:
            with torch.device("meta"):
                plain = GPT(self.model.config)
            plain = distributed.full_copy(self.model, plain.materialize(self.device))
            yield plain.eval()
            return
        was_training = self.model.training
        self.model.eval()
        try:
            with self.fp8.high_precision(), self._eager():
                yield self.model
        finally:
            self.model.train(was_training)

    def sample(self, num_samples: int) -> list[str]:
        """Continue the first tokens of a few validation documents (high precision); on rank 0
        only (the other ranks return [])."""
        cfg = self.config
        if self.corpus.kind == "instruct":  # the conversation up to its last answer + generation prompt
            prompts = [instruct.generation_prompt(self.tokenizer, r) for r in self.corpus.val_records[:num_samples]]
        else:
            prompts = [self.tokenizer.encode(d, prepend_bos=True)[:16]
                       for d in self.corpus.val_docs if d.strip()][:num_samples]
        out = []
        with self._eval_model() as model, self.autocast:
            for i, ids in enumerate(prompts if self.dist.rank == 0 else []):
                gen = engine.generate(
                    model, ids, max_new_tokens=cfg.sample_tokens, temperature=cfg.temperature,
                    top_k=cfg.top_k, seed=cfg.seed + i,
                )
                # generate() returns only the new tokens; show the prompt with its continuation
                out.append(self.tokenizer.decode([t for t in ids + gen if t != self.tokenizer.bos_id]))
        return out

    # ---------------------------------------------------------------- persist
    def _save(self, step: int, record: dict[str, Any] | None = None) -> None:
        """A checkpoint in a single process (checkpoint.py), a DCP directory (every rank) when
        distributed; both verified, the newest --keep_checkpoints kept; the format not
        written is deleted afterwards, so a resume finds one. A model or optimizer state holding
        inf/nan is never written: the run stops, naming the last checkpoint that is good.
        `record`: this step's metrics line when it is logged after the save (the last step's,
        which waits for the final evaluation), so a resume can log it if the run died between."""
        bad = self._nonfinite_state()
        if bad:
            raise NanoChatError(
                f"step {step}: not saving, {bad} hold inf/nan. Step {step}'s loss and gradients were "
                f"finite, so its update made them so (or an earlier update, in weights no batch since "
                f"used). {self._good_checkpoint_note()}: lower --lr, check the data, or try "
                "--fp8_mode e5m2 / auto")
        meta = {
            "config": self.config.to_dict(),
            "resolved_paths": self._resolved_paths(),
            "step": step,
            "world_size": self.dist.world_size,
            "data": self.loader.state_dict(),
            "tokenizer_fingerprint": self.tokenizer.fingerprint,
            # counters, and --fp8_mode auto's measured formats (a resumed run does not recalibrate)
            # with --fp8_auto_recheck_every's switches so far and its pending disagreements
            **self.fp8.state_dict(),
            "record": record,
        }
        if self.dist.is_distributed:
            rng = {f"rng_{k}": v for k, v in rng_state().items() if k == "cpu"}
            distributed.save_dcp(self.run_dir, self.model, self.optimizer, step=step, meta=meta, tensors=rng,
                                 keep=self.config.keep_checkpoints)
            if self.dist.rank == 0:
                checkpoint.remove_checkpoints(self.run_dir)
            return
        save_checkpoint(self.run_dir, {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": rng_state(),
            **meta,
        }, step=step, keep=self.config.keep_checkpoints)
        distributed.remove_dcp(self.run_dir)

    def _nonfinite_state(self) -> str:
        """'' when every parameter and optimizer state is finite, else which tensors are not.

        One flag per tensor, stacked and reduced once: a single device-to-host read for the whole
        model (the per-tensor names are looked up only when something is wrong)."""
        def finite(t: torch.Tensor) -> torch.Tensor | None:
            t = t.to_local() if isinstance(t, distributed.DTensor) else t
            if isinstance(t, FP8Tensor):
                return torch.isfinite(t.codes.float()).all() & torch.isfinite(t.scale).all()
            return torch.isfinite(t).all() if t.is_floating_point() and t.numel() else None

        named = [(f"parameter {n}", finite(p.detach())) for n, p in self.model.named_parameters()]
        for i, st in enumerate(self.optimizer.state_dict()["state"].values()):
            named += [(f"optimizer state {i}.{k}", finite(v)) for k, v in st.items()
                      if isinstance(v, torch.Tensor) and v.ndim]
        named = [(n, f) for n, f in named if f is not None]
        if not named:
            return ""
        flags = torch.stack([f for _, f in named])
        bad = distributed.all_reduce_sum((~flags).sum().float().reshape(1))  # every rank decides alike
        if bad.item() == 0:
            return ""
        names = [n for (n, _), ok in zip(named, flags.tolist()) if not ok]
        return (f"{len(names)} of {len(named)} tensors on this rank ({', '.join(names[:3])}"
                f"{', ...' if len(names) > 3 else ''})" if names else "tensors on another rank")

    def _good_checkpoint_note(self) -> str:
        """Which checkpoint a resume would start from, checked now: its checksums, and its weights
        and optimizer states loaded and found finite (DCP: by rank 0 only, without communication:
        this runs on error paths, where ranks may diverge)."""
        if self.dist.is_distributed:
            if self.dist.rank == 0:
                dcp, checked = distributed.last_good_dcp(self.run_dir, finite=True), "verified, finite"
            else:
                dcp, checked = distributed.latest_dcp(self.run_dir), "rank 0 checks it"
            return (f"The last good checkpoint is {dcp} (step {distributed.dcp_step(dcp)}, {checked})" if dcp
                    else f"No good checkpoint of this run is in {self.run_dir}")
        good = checkpoint.last_good_checkpoint(self.run_dir, finite=True)
        if good is None:
            return f"No good checkpoint of this run is in {self.run_dir}"
        return f"The last good checkpoint is {good.path} (step {good.step}, verified, finite)"

    def _resolved_paths(self) -> dict[str, str | None]:
        """The path-valued fields as absolute, symlink-free paths: what resume compares (so `tok/`
        and `tok`, relative and absolute, name the same directory)."""
        cfg = self.config
        out = {}
        for k in ("model_name", "dataset_path", "tokenizer_dir", "init_from"):
            v = getattr(cfg, k)
            out[k] = None if v is None else (os.path.realpath(v) if os.path.exists(v) else v)
        return out

    def _find_checkpoint(self, run_dir: Path, flag: str) -> tuple[str, Path, int] | None:
        """("pt", file, step) or ("dcp", step directory, step): the newest checkpoint of run_dir, or
        None. Both formats exist only after a crash between writing one and deleting the other;
        the later step wins. A checkpoint without a manifest that is newer is refused: falling
        back to an older one would silently lose its steps."""
        dcp_dir, pt = distributed.latest_dcp(run_dir), checkpoint.latest_checkpoint(run_dir)
        found = ([("dcp", dcp_dir, distributed.dcp_step(dcp_dir))] if dcp_dir else []) + (
            [("pt", pt.path, pt.step)] if pt else [])
        newest = max(found, key=lambda f: f[2], default=None)  # a tie: the first, DCP
        loose = ([(c.path, c.step) for c in checkpoint.uncommitted(run_dir)]
                 + [(p, distributed.dcp_step(p)) for p in distributed.uncommitted_dcp(run_dir)])
        newest_loose = max(loose, key=lambda f: f[1], default=None)
        if newest_loose is not None and (newest is None or newest_loose[1] > newest[2]):
            older, older_step = newest[1:] if newest else (None, None)
            raise UsageError(checkpoint.unmanifested_message(newest_loose[0], flag, older, older_step))
        return newest

    def _read_meta(self, kind: str, path: Path, flag: str, keys: tuple[str, ...]) -> dict[str, Any]:
        """The checkpoint at `path`, verified: a .pt's whole payload (memory-mapped for
        --init_from), a DCP step's trainer.json; a NanoChatError naming what is wrong."""
        if kind == "pt":
            keys = keys + (("model", "optimizer", "rng") if flag == "--resume" else ("model",))
            return load_checkpoint(path, map_location=self.device if flag == "--resume" else "cpu",
                                   keys=keys, mmap=flag != "--resume", flag=flag)
        if flag == "--resume":
            distributed.verify_dcp(path)  # collective: rank 0 reads, every rank gets the verdict
        else:
            problem = distributed.dcp_problem(path)
            if problem is not None:
                raise NanoChatError(f"{flag} {path.parent.parent}: its newest checkpoint {path} is not usable "
                                    f"({problem}); restore it, or move it away to start from the run's previous "
                                    "checkpoint")
        try:
            meta = distributed.read_dcp_meta(path)
        except (OSError, ValueError) as e:
            meta, problem = None, f"its {distributed.META_NAME} does not read ({e})"
        else:
            missing = checkpoint.missing_keys(meta, keys) if isinstance(meta, dict) else list(keys)
            problem = (f"its {distributed.META_NAME} lacks {', '.join(map(repr, missing))}" if missing else
                       None if meta["step"] == distributed.dcp_step(path) else
                       f"it holds step {meta['step']} under the name of step {distributed.dcp_step(path)}")
        if problem is not None:
            raise NanoChatError(f"{flag}: DCP checkpoint {path} is not usable: {problem}; move it out of "
                                f"{path.parent} to use the previous step")
        return meta

    def _resume(self) -> int:
        kind, source, _ = self._find_checkpoint(self.run_dir, "--resume")
        ckpt = self._read_meta(kind, source, "--resume", _RESUME_KEYS)
        saved = ckpt["config"]
        now = self.config.to_dict()
        saved_paths = ckpt.get("resolved_paths") or {}
        resolved_now = self._resolved_paths()

        def same(k: str) -> bool:
            if saved.get(k, _RESUME_DEFAULTS.get(k)) == now[k]:
                return True
            if k == "fp8_layers" and not (saved.get("fp8") or now["fp8"]):
                return True  # which layers FP8 converts is moot in a run without FP8
            return k in resolved_now and saved_paths.get(k, saved.get(k)) == resolved_now[k]

        diff = {k: (saved.get(k, _RESUME_DEFAULTS.get(k)), now[k]) for k in _RESUME_MUST_MATCH if not same(k)}
        saved_ranks = ckpt.get("world_size", 1)
        if saved["batch_size"] * saved_ranks != now["batch_size"] * self.dist.world_size:
            diff["batch_size"] = (f"{saved['batch_size']} x {saved_ranks} ranks",
                                  f"{now['batch_size']} x {self.dist.world_size} ranks")
        if diff:
            lines = ", ".join(f"--{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
            raise UsageError(f"--resume: this run's settings differ from the checkpoint's ({lines}); "
                             "use the checkpoint's values or a new --run_dir")
        if ckpt["tokenizer_fingerprint"] != self.tokenizer.fingerprint:
            raise UsageError("--resume: the tokenizer differs from the one the checkpoint was trained "
                             "with; pass the same --tokenizer_dir (or the same corpus and --vocab_size)")
        if kind == "dcp":
            tensors = {"rng_cpu": torch.get_rng_state()}
            distributed.load_dcp(source, self.model, self.optimizer, tensors=tensors, verify=False)
            ckpt["rng"] = {"cpu": tensors["rng_cpu"]}
        elif self.dist.is_distributed and self.config.fsdp:
            distributed.load_full_state_dicts(self.model, self.optimizer, ckpt["model"], ckpt["optimizer"])
        else:
            self.model.load_state_dict(ckpt["model"])
            self.optimizer.load_state_dict(ckpt["optimizer"])
        bad = self._nonfinite_state()
        if bad:
            raise NanoChatError(f"--resume: checkpoint {source} holds inf/nan ({bad}), so training cannot continue "
                                f"from it; move it out of {source.parent} to resume from the previous checkpoint")
        self.loader.load_state_dict(ckpt["data"])
        set_rng_state(ckpt["rng"])
        try:
            self.fp8.load_state_dict(ckpt)
        except ValueError as e:  # FP8 choices that do not fit this model: say it in flags
            raise ValueError(flag_text(str(e))) from None
        logger.info("resumed from %s at step %d", source, ckpt["step"])
        self.resumed_record = ckpt.get("record")
        return int(ckpt["step"])

    def _truncate_metrics(self, step: int, record: dict[str, Any] | None) -> list[dict[str, Any]]:
        """Drop metrics.jsonl's lines from the first record after `step` on: the steps a resume
        repeats were logged by the interrupted run, and each step must appear once. `record`, the
        checkpoint's own line for `step`, is appended when the run died before logging it.
        Returns the records kept: the run's history up to `step`."""
        path = self.run_dir / "metrics.jsonl"
        lines = path.read_text().splitlines(keepends=True) if path.is_file() else []
        kept = []
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut by the kill
                break
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] > step:
                break
            kept.append(rec)
        logged = any(isinstance(r, dict) and "loss" in r and r.get("step") == step for r in kept)
        tail = [_json_line(record)] if record is not None and not logged else []
        if len(kept) < len(lines) or tail:
            write_atomic(path, "".join(lines[:len(kept)] + tail))
        return [r for r in kept if isinstance(r, dict)] + ([_jsonable(record)] if tail else [])

    def _log(self, record: dict[str, Any]) -> None:
        if self.dist.rank == 0:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(_json_line(record))

    def _fp8_summary(self, label: str) -> dict[str, Any]:
        """The per-epoch (and final) FP8 report: printed, logged to metrics.jsonl, returned."""
        summary = self.fp8.summary()
        print0(self.fp8.summary_text(summary, label))
        self._log({"event": "fp8_summary", "label": label, **summary})
        return summary

    # ------------------------------------------------------------------- step
    def _train_step(self, step: int) -> dict[str, Any]:
        """One optimizer step; returns its metrics record.

        In the steady state it reads the device once: loss and gradient norm travel to the host
        together, one small tensor, and decide the skip of a non-finite step and the clipping
        event. Steps that sample FP8 statistics or calibrate add a bounded number of reads (one
        per sample, one per calibration decision), the naming of a non-finite layer a few more."""
        cfg = self.config
        lr = cfg.lr * lr_multiplier(step, self.total_steps, cfg.warmup_steps, cfg.final_lr_frac)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # FP8 statistics and auto's calibration run on the eager model (hooks would force recompiles)
        fp8_step = self.fp8.begin_step(step)
        eager = fp8_step.eager or self._eager_only
        module = self.dist_model if eager else self.compiled
        loss_sum = torch.zeros((), device=self.device)
        with fp8_step, (self._eager() if eager else contextlib.nullcontext()):
            for micro in range(cfg.grad_accum_steps):
                x, y = self.loader.next_batch(self.device)
                with distributed.no_grad_sync(module, skip=micro < cfg.grad_accum_steps - 1):
                    loss = self._forward(module, x, y, compiled=not eager)
                    (loss / cfg.grad_accum_steps).backward()
                loss_sum += loss.detach()
        if not eager:
            self._compile_pending = False
        # the mean over ranks: what one process with the global batch would log, and the same
        # value on every rank, so all ranks agree on skipping a non-finite step
        loss_mean = distributed.all_reduce_mean(loss_sum) / cfg.grad_accum_steps
        if cfg.optimizer_in_backward:  # the backward was the update
            return self._in_backward_record(step, lr, loss_mean, fp8_step)
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")

        def rerun() -> None:  # the forward again, eagerly, to find where a non-finite loss began
            with self._eager():
                self.model(x, y)

        verdict = self.guard.check(step, loss_mean, self.params, max_norm=max_norm, rerun=rerun,
                                   note=self._good_checkpoint_note)
        record: dict[str, Any] = {"step": step + 1, "loss": verdict.loss, "lr": lr, "grad_norm": verdict.grad_norm}
        record.update(fp8_step.record())  # every rank: the global batch's statistics
        record.update(verdict.flags)
        if verdict.skipped:  # non-finite: the gradients were dropped, the weights stay
            return record
        gradient_bytes = sum(distributed.local_numel(p.grad) * p.grad.element_size()
                             for p in self.params if p.grad is not None) if not self.state_bytes else 0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._measure_state(gradient_bytes)
        self._after_optimizer_step(step)
        return record

    def _in_backward_record(self, step: int, lr: float, loss_mean: torch.Tensor, fp8_step) -> dict[str, Any]:
        """The metrics of a step whose update ran inside the backward (--optimizer_in_backward),
        in one read: the loss, the norm of the finite gradients and, when some gradient was not
        finite, `skipped_params` (how many parameters kept their values) and
        `skipped_param_names`. The step counts as skipped (the overflow counters and the
        --fp8_max_overflows stop) only when nothing was updated: the loss was not finite, or every
        parameter with a gradient was left unchanged. Otherwise the finite ones moved."""
        stats = self.optimizer.backward_stats(per_param=True)
        stats = torch.zeros(3, device=self.device) if stats is None else stats
        values = host_read(torch.cat([loss_mean.float().view(1), stats.to(self.device)]))
        loss_value, grad_norm, skipped, with_grad = values[:4]
        record: dict[str, Any] = {"step": step + 1, "loss": loss_value, "lr": lr, "grad_norm": grad_norm}
        record.update(fp8_step.record())
        nothing_updated = not math.isfinite(loss_value) or (skipped and skipped == with_grad)
        if skipped:
            names = {id(p): n for n, p in self.model.named_parameters()}
            hooked = [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]
            record["skipped_params"] = int(skipped)
            record["skipped_param_names"] = [names.get(id(p), f"#{i}") for i, (p, flag) in
                                             enumerate(zip(hooked, values[4:])) if flag]
            if not nothing_updated:
                logger.warning("step %d: non-finite gradient of %s; left unchanged, the other parameters updated",
                               step + 1, ", ".join(record["skipped_param_names"]))
        # a finite norm resets the count of skipped steps in a row
        record.update(self.guard.decide(step, loss_value, math.nan if nothing_updated else grad_norm,
                                        note=self._good_checkpoint_note))
        self._measure_state(self.optimizer.max_live_grad_bytes)
        self._after_optimizer_step(step)
        return record

    def _measure_state(self, gradient_bytes: int) -> None:
        """After the first optimizer step: the bytes of weights, gradients and optimizer states
        held for training (TrainResult.state_bytes)."""
        if self.state_bytes:
            return
        weights = sum(distributed.local_numel(p) * p.element_size() for p in self.model.parameters())
        self.state_bytes = {"weights": weights, "gradients": gradient_bytes,
                            "optimizer": optimizer_state_bytes(self.optimizer)}

    def _after_optimizer_step(self, step: int) -> None:
        """FP8's bookkeeping of the update (calibration, re-checks, FSDP scales) and its events."""
        if self.fp8.end_step(step) and self.config.compile:  # auto's formats are fixed: compile next step
            self._compile_pending = True
        for event in self.fp8.pop_events():
            self._log(event)

    def _forward(self, module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, compiled: bool) -> torch.Tensor:
        """The training forward; the first compiled one falls back to eager if compiling fails."""
        if not (compiled and self._compile_pending):
            with self.autocast:
                return module(x, y)
        try:
            with self.autocast:
                return module(x, y)
        except Exception as e:  # noqa: BLE001 -- any compiler failure; training goes on eagerly
            if not _is_compile_failure(e):
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            self._fallback(f"compile: torch.compile failed ({type(e).__name__}: {first[:240]}); training "
                           "eagerly. Install a C++ compiler (CPU builds) or pass --no_compile to skip the attempt")
            self._uncompile()
            with self.autocast, self._eager():
                return self.dist_model(x, y)

    # ------------------------------------------------------------------ train
    def train(self) -> TrainResult:
        try:
            return self._train()
        finally:
            if self._locked is not None:
                runlock.release(self._locked)
                self._locked = None
            distributed.destroy_distributed()  # only a process group init_distributed created

    def _train(self) -> TrainResult:
        """Setup, resume, the loop (step, evaluate, log, save), the result."""
        t_start = time.perf_counter()
        cfg = self.config
        self._setup()
        start_step = self._resume() if cfg.resume else 0
        history: list[dict[str, Any]] = []  # metrics.jsonl's records before this call's first step
        if self.dist.rank == 0:
            if cfg.resume:
                history = self._truncate_metrics(start_step, self.resumed_record)
            elif isinstance(self.tokenizer, Tokenizer):
                self.tokenizer.save(self.run_dir / "tokenizer", overwrite=cfg.overwrite)
            else:
                self.tokenizer.save(self.run_dir / "tokenizer")
        self._print_header()
        val_loss = val_bpb = float("nan")
        val_accuracy = None
        if start_step == 0 and (self.num_choice_items or cfg.init_from):  # the starting point fine-tuning improves on
            val_loss0, val_bpb0, val_accuracy = self._evaluate_all()
            self._log({"step": 0, "val_loss": val_loss0, "val_bpb": val_bpb0, "val_accuracy": val_accuracy})
            acc = (f", val accuracy {val_accuracy:.4f} ({self.num_choice_items} questions, "
                   f"{self.accuracy_scoring})" if val_accuracy is not None else "")
            print0(f"step 0: val loss {val_loss0:.4f}{acc}")
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum_steps * self.dist.world_size
        # a resumed run reports what the uninterrupted one would: its last losses include those
        # logged before the resume, and with no step left to time, the throughput last logged
        logged = [r for r in history if isinstance(r.get("loss"), float) and not r.get("skipped")]
        recent_losses: list[float] = [r["loss"] for r in logged][-20:]
        logged_tok_s = next((r["tokens_per_sec"] for r in reversed(logged)
                             if isinstance(r.get("tokens_per_sec"), float)), float("nan"))
        timed_tokens, timed_seconds = 0, 0.0
        self.model.train()
        bar = tqdm(total=self.total_steps, initial=start_step, disable=self.dist.rank != 0,
                   dynamic_ncols=True, desc="train")
        for step in range(start_step, self.total_steps):
            t0 = time.perf_counter()
            epoch_before = int(self.loader.epoch)
            compiles = self._compile_pending  # this step traces and compiles the model
            record = self._train_step(step)
            dt = time.perf_counter() - t0
            bar.update(1)
            if record.get("skipped"):
                self._log(record)
                if step + 1 == self.total_steps:  # the weights are the last update's: they are the result
                    self._save(self.total_steps)
                continue
            if compiles:  # compile time is reported on its own, not in tokens/s
                self.compile_time_s += dt
            elif not record.get("calibrating"):  # auto's eager calibration steps are excluded too
                timed_tokens += tokens_per_step
                timed_seconds += dt
            tok_s = timed_tokens / timed_seconds if timed_seconds else tokens_per_step / dt
            record["tokens_per_sec"] = tok_s
            utilization = self._mfu(tok_s)
            if utilization is not None:
                record["mfu"] = utilization
            recent_losses = (recent_losses + [record["loss"]])[-20:]
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{tok_s:,.0f}", lr=f"{record['lr']:.2e}",
                            **({"mfu": f"{utilization:.1%}"} if utilization is not None else {}))

            done = step + 1
            is_last = done == self.total_steps
            # before the final evaluation: an error there must not lose the trained weights
            if is_last and cfg.save_checkpoints:
                self._save(done, record)
            if (cfg.eval_every and done % cfg.eval_every == 0) or is_last:
                val_loss, val_bpb, val_accuracy = self._evaluate_all()
                record.update(val_loss=val_loss, val_bpb=val_bpb)
                if val_accuracy is not None:
                    record["val_accuracy"] = val_accuracy
                if self.dist.rank == 0:
                    bar.write(f"step {done}: val loss {val_loss:.4f}, val bpb {val_bpb:.4f}"
                              + (f", val accuracy {val_accuracy:.4f}" if val_accuracy is not None else ""))
            self._log(record)
            if cfg.fp8 and int(self.loader.epoch) > epoch_before and not is_last:
                self._fp8_summary(f"epoch {int(self.loader.epoch)}")
            if cfg.save_checkpoints and cfg.save_every and done % cfg.save_every == 0 and not is_last:
                self._save(done)
        bar.close()
        self.fp8.finish()  # a calibration the run did not complete keeps the hybrid (recorded)

        if not math.isfinite(val_bpb):  # resumed at the end, or the last step was skipped
            val_loss, val_bpb, val_accuracy = self._evaluate_all()
        result = self._result(
            train_loss=sum(recent_losses) / len(recent_losses) if recent_losses else float("nan"),
            val_loss=val_loss, val_bpb=val_bpb, val_accuracy=val_accuracy,
            tokens_per_sec=timed_tokens / timed_seconds if timed_seconds else logged_tok_s,
            wall_time_s=time.perf_counter() - t_start)
        if self.dist.rank == 0:
            write_atomic(self.run_dir / "result.json",
                         json.dumps(_jsonable(result.to_dict()), indent=2, allow_nan=False))
        return result

    def _evaluate_all(self) -> tuple[float, float, float | None]:
        """Validation loss, bits per byte and multiple-choice accuracy (None without choices)."""
        val_loss, val_bpb = self.evaluate()
        return val_loss, val_bpb, self.evaluate_accuracy()

    def _mfu(self, tokens_per_sec: float, *, fp8: bool = False) -> float | None:
        """MFU against the dense bf16 peak, or with `fp8` the FP8 peak (only for native FP8
        layers); None where that peak is unknown or nothing was timed."""
        report = self.fp8.report
        if fp8 and not (report is not None and report.backend == "native" and report.converted):
            return None
        peak = None if self.peak is None else self.peak.fp8_tflops if fp8 else self.peak.bf16_tflops
        if peak is None or not math.isfinite(tokens_per_sec):
            return None
        return mfu.utilization(tokens_per_sec, self.flops_per_token, peak, self.dist.world_size)

    def _result(self, **measured: Any) -> TrainResult:
        """The run's TrainResult: `measured` (losses, throughput, time) and what the run recorded.
        Prints and logs the final FP8 summary and generates the samples first."""
        cfg = self.config
        fp8_stats = self._fp8_summary("end of training") if cfg.fp8 else dict(self.fp8.counters)
        report = self.fp8.report
        return TrainResult(
            **measured,
            steps=self.total_steps,
            epochs=self.loader.epoch,
            compile_time_s=self.compile_time_s,
            fallbacks=(self.fallbacks + [flag_text(f) for f in self.fp8.fallbacks + (
                self.optimizer.fp32_state_notes() + self.optimizer.fallbacks if isinstance(self.optimizer, FP8Optim) else [])]),
            optimizer_state_bytes=self.optimizer_state_bytes,
            num_params=self.model.num_params(),
            fp8_backend=report.backend if report is not None else "off",
            fp8_converted=list(report.converted) if report is not None else [],
            fp8_skipped={n: flag_text(why) for n, why in report.skipped.items()} if report is not None else {},
            fp8_decisions={n: flag_text(why) for n, why in report.decisions.items()} if report is not None else {},
            fp8_measure_time_s=report.measure_time_s if report is not None else 0.0,
            fp8_choices=self.fp8.choices,
            fp8_stats=fp8_stats,
            accuracy_scoring=self.accuracy_scoring,
            samples=self.sample(cfg.num_samples) if cfg.num_samples else [],
            run_dir=str(self.run_dir),
            parallel=self.parallel,
            state_bytes_per_param=sum(self.state_bytes.values()) / max(1, sum(
                distributed.local_numel(p) for p in self.model.parameters())),
            state_bytes=dict(self.state_bytes),
            planned_memory_bytes=self.memory_plan.total,
            peak_memory_bytes=torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None,
            flops_per_token=self.flops_per_token,
            peak_tflops=None if self.peak is None else self.peak.bf16_tflops,
            mfu=self._mfu(measured["tokens_per_sec"]),
            mfu_fp8=self._mfu(measured["tokens_per_sec"], fp8=True),
        )
