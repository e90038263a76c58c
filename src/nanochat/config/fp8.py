"""FP8Config: everything that decides how a model trains in FP8, in one frozen dataclass.

The command line's FP8 flags (`--fp8`, `--fp8_mode`, ...) are generated from these fields by
nanochat.config.fields, so each field is defined, documented and validated here once. A field
with a flag carries its help as a value, `tyro.conf.arg(help=...)` in its annotation, rather than
as the docstring under it: a docstring lives only in the source file, and an install of bytecode
alone (a zipapp, a stripped image) would lose the help. This file imports nothing heavy: parsing
flags (and `--help`) does not load torch or torchao.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Annotated, Literal, get_args

from tyro.conf import arg

ROLES = ("input", "weight", "grad_output")
"""The three tensors a Linear casts to FP8; each role has one dtype in both GEMMs it feeds."""

HYBRID = {"input": "e4m3", "weight": "e4m3", "grad_output": "e5m2"}
"""`auto` before calibration: e4m3 forward operands, e5m2 gradients (torchao's tensorwise default)."""

FP8Mode = Literal["e4m3", "e5m2", "auto"]
FP8Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "mxfp8_wgrad_hp"]
FP8Layers = Literal["faster", "all"]
MODES, RECIPES, LAYERS = get_args(FP8Mode), get_args(FP8Recipe), get_args(FP8Layers)
MX_RECIPES = ("mxfp8", "mxfp8_wgrad_hp")
"""The MXFP8 recipes (torchao's MXFP8 training): e4m3 values with one power-of-two (e8m0) scale
per block of MX_BLOCK consecutive values along each GEMM's inner dimension."""
MX_BLOCK = 32
"""MXFP8's block: the OCP Microscaling spec's and Blackwell's MX tensor cores' (torchao's `block_size`)."""


@dataclass(frozen=True, kw_only=True)
class FP8Config:
    """How a model is converted to FP8 and watched while it trains (`nanochat.fp8.FP8Training`)."""

    enabled: Annotated[bool, arg(help="""
        Run eligible nn.Linear layers' three GEMMs in FP8 through torchao (needs sm_89+ for real
        FP8 kernels; elsewhere it warns once and trains in high precision unless `emulate`). `mode`,
        `recipe`, `layers`, `emulate`, `skip_fqns`, `min_dim`, `auto_steps`, `auto_recheck_every`
        and `stats_every` describe those layers and need it; `opt_level` does not.""")] = True

    mode: Annotated[FP8Mode, arg(help="""
        FP8 format of the matmul operands. e4m3: 3 mantissa bits, range +-448 (more precision);
        e5m2: 2 mantissa bits, range +-57344 (more range); auto: chosen per layer and tensor role by
        measured quantization error during the first `auto_steps` steps. The MXFP8 recipes take e4m3
        only (their block scales give e4m3 the range e5m2 would).""")] = "e4m3"

    recipe: Annotated[FP8Recipe, arg(help="""
        torchao scaling recipe: one scale per tensor (fastest), per row, or per row with the
        weight-gradient GEMM kept in high precision (Ada, Hopper and later); mxfp8: MXFP8, e4m3 with
        one power-of-two scale per block of 32 values, in all three GEMMs (Blackwell, sm_100+; `mode`
        e4m3 only), or mxfp8_wgrad_hp with the weight-gradient GEMM in high precision.""")] = "tensorwise"

    layers: Annotated[FP8Layers, arg(help="""
        Which eligible Linear layers run in FP8. faster: only those FP8 makes faster at this run's
        shapes. On a GPU with FP8 kernels each distinct layer shape is timed once (compiled
        forward+backward, FP8 against bf16, at the run's tokens per micro-batch) and converted where
        FP8 is at least 3% faster; the timings are cached on disk, so only a first run spends seconds
        measuring (reported apart, like compile time). Elsewhere (`emulate`, CPU) torchao's rule for
        the recipe decides (from H100 tables), so an emulated run converts the layers a GPU run most
        likely would. all: every layer the other rules allow, also where FP8 is slower, e.g. for its
        activation-memory saving alone (d12 on an H200: 9.8 GiB peak against bf16's 13.8).""")] = "faster"

    emulate: Annotated[bool, arg(help="""
        Simulate FP8 matmul numerics in high precision on any device (slow; for tests and
        numerics studies). Implies the FP8 path even without FP8 hardware.""")] = False

    opt_level: Annotated[Literal[0, 1, 2], arg(help="""
        Adam moments in FP8: 0 keeps both in fp32; 1 stores the first moment (momentum) in FP8;
        2 stores both moments in FP8. Only storage (uint8 codes and fp32 block scales), so it works on
        any device and with or without FP8 layers (`enabled`): an A100 or a CPU saves the same 6 bytes
        a parameter at level 2.""")] = 0

    skip_fqns: Annotated[tuple[str, ...], arg(help="""
        Module-name patterns (fnmatch, matched against the full name) never converted to FP8.
        The output head is skipped by default: its logits feed a softmax over the whole vocabulary
        and are the most precision-sensitive matmul of the model.""")] = ("lm_head",)

    min_dim: Annotated[int, arg(help="""
        Linear layers with min(in_features, out_features) below this stay in high precision:
        the casts cost more than the FP8 GEMM saves (128 is a judgment, not a measurement: docs/fp8.md).""")] = 128

    auto_steps: Annotated[int, arg(help="""
        `mode` auto: number of forward+backward passes measured before formats are fixed.""")] = 4

    auto_recheck_every: Annotated[int, arg(help="""
        `mode` auto: every N steps after calibration, measure both formats again and switch a
        layer's role to the other format once the calibration rule has picked it at 2 re-checks in a
        row (e.g. a gradient whose small values started to flush to zero after the first steps).
        Switches are logged, listed in the summary and kept in checkpoints; a re-check step also
        records the FP8 statistics. 0 (default): formats stay as calibrated.""")] = 0

    stats_every: Annotated[int, arg(help="""
        Sample per-layer FP8 statistics (amax, underflow, saturation, SQNR) every N steps; 0 turns
        them off. A sampled step runs the uncompiled model with hooks and costs about 2.8 plain
        steps more, so at 200 statistics take about 1.4% of the run's time.""")] = 200

    fsdp_float8_all_gather: bool = False
    """Under FSDP2, all-gather each converted weight already in FP8 (torchao's
    `enable_fsdp_float8_all_gather`): a quarter of fp32's bytes, the same numerics, since the scale
    comes from the whole weight. Needs `recipe` tensorwise and one weight format (not `mode` auto).
    Set by whoever shards the model, before converting: the converted weights become new
    Parameters, so build the optimizer after conversion. Not a command-line flag: nanochat's
    trainer sets it when it shards with FSDP2 and these conditions hold."""

    micro_batch_tokens: int | None = None
    """Tokens per forward pass (batch size x sequence length: the M of every Linear's GEMMs), at
    which `layers` faster times the layers. Not a command-line flag: nanochat's trainer sets it.
    Without it a GPU run decides by torchao's rule and records why."""

    converted_layers: tuple[str, ...] | None = None
    """Exactly which layers convert, replacing the `layers` rule (and its timing): a resumed run
    converts the layers the run it continues converted, whatever the timings say now (`layers`
    faster depends on the GPU and the timing cache). The other rules still apply. Not a
    command-line flag: nanochat's trainer sets it from the checkpoint (FP8Training.state_dict's
    `fp8_converted`); None: the rules decide."""

    def __post_init__(self) -> None:
        # Messages name fields as `field`: the CLI shows them as its flags (nanochat.config).
        if self.mode not in MODES:
            raise ValueError(f"`mode` must be one of {', '.join(MODES)}, got {self.mode!r} (e4m3 is the default)")
        if self.recipe not in RECIPES:
            raise ValueError(f"`recipe` must be one of {', '.join(RECIPES)}, got {self.recipe!r} "
                             "(tensorwise is the default)")
        if self.layers not in LAYERS:
            raise ValueError(f"`layers` must be one of {', '.join(LAYERS)}, got {self.layers!r} "
                             "(faster is the default)")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ValueError(f"`micro_batch_tokens` must be >= 1 (batch size x sequence length) or None, "
                             f"got {self.micro_batch_tokens}")
        if self.recipe in MX_RECIPES:
            self._check_mx()
        if self.opt_level not in (0, 1, 2) or isinstance(self.opt_level, bool):
            raise ValueError(f"`opt_level` must be one of 0, 1, 2, got {self.opt_level!r}")
        if isinstance(self.skip_fqns, str):
            raise ValueError(f"skip_fqns must be a sequence of patterns, got the string {self.skip_fqns!r}; "
                             f"write skip_fqns=({self.skip_fqns!r},)")
        object.__setattr__(self, "skip_fqns", tuple(self.skip_fqns))
        if self.converted_layers is not None:
            object.__setattr__(self, "converted_layers", tuple(self.converted_layers))
        if self.min_dim < 16:
            raise ValueError(f"`min_dim` must be >= 16 (FP8 GEMM dimensions are multiples of 16), got {self.min_dim}")
        if self.auto_recheck_every and self.mode != "auto":
            raise ValueError("`auto_recheck_every` re-checks the formats of `mode` auto; use `mode` auto "
                             f"or drop it (mode is {self.mode})")
        if self.fsdp_float8_all_gather and self.recipe != "tensorwise":
            raise ValueError(f"`fsdp_float8_all_gather` needs `recipe` tensorwise (one scale per weight); "
                             f"recipe {self.recipe} scales per {'block' if self.recipe in MX_RECIPES else 'row'}, "
                             "so its weights all-gather in high precision")
        if self.fsdp_float8_all_gather and self.mode == "auto":
            raise ValueError("`fsdp_float8_all_gather` needs one weight format for every layer; `mode` auto "
                             "may choose per layer: use `mode` e4m3 or e5m2, or leave it off")
        for name, least in (("auto_steps", 1), ("auto_recheck_every", 0), ("stats_every", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"`{name}` must be >= {least}{' (0: off)' if least == 0 else ''}, "
                                 f"got {getattr(self, name)}")
        if not self.enabled:
            defaults = {f.name: f.default for f in fields(FP8Config)}
            for name in LAYER_FIELDS:
                if getattr(self, name) != defaults[name]:
                    raise ValueError(f"`{name}` {getattr(self, name)!r} describes FP8 layers, and without "
                                     f"`enabled` there are none: turn on `enabled`, or drop `{name}` "
                                     "(`opt_level` alone needs no FP8 layers)")

    def _check_mx(self) -> None:
        # torchao's MXFP8 training casts every operand to e4m3 (mxfp8_linear.py), as Blackwell's MX
        # tensor cores run it: there is no e5m2 to choose, so e5m2 and auto are refused, not mapped
        if self.mode != "e4m3":
            what = "chooses e4m3 or e5m2 per layer and role" if self.mode == "auto" else "asks for e5m2 operands"
            raise ValueError(f"`mode` {self.mode} {what}, but `recipe` {self.recipe} casts every operand to e4m3 "
                             f"(torchao's MXFP8 training has no e5m2): use `mode` e4m3 with `recipe` {self.recipe}, "
                             f"or `recipe` tensorwise/rowwise for `mode` {self.mode}")
        if self.recipe == "mxfp8" and self.micro_batch_tokens is not None and self.micro_batch_tokens % MX_BLOCK:
            raise ValueError(f"`recipe` mxfp8 scales the weight-gradient GEMM's operands in blocks of {MX_BLOCK} "
                             f"tokens, so the tokens per forward pass (batch size x sequence length, here "
                             f"{self.micro_batch_tokens}) must be a multiple of {MX_BLOCK}; change the batch size "
                             "or sequence length, or use `recipe` mxfp8_wgrad_hp (that GEMM in high precision)")

    def role_dtypes(self) -> dict[str, str]:
        """The format of each role at conversion time (auto: the hybrid until calibrated)."""
        if self.mode == "auto":
            return dict(HYBRID)
        return {role: self.mode for role in ROLES}


LAYER_FIELDS = ("mode", "recipe", "layers", "emulate", "skip_fqns", "min_dim", "auto_steps", "auto_recheck_every",
                "stats_every")
"""FP8Config fields that describe FP8 layers: set to anything but their default, they need `enabled`."""

RESUME_FIELDS = ("enabled", "mode", "recipe", "layers", "opt_level", "skip_fqns", "min_dim")
"""FP8Config fields a resumed run must share with its checkpoint: they decide which layers are FP8,
in which formats, and how the optimizer state is stored (`emulate` may differ: a run can move
between an emulating CPU and a GPU with FP8 kernels)."""
