"""FP8 matmuls for nn.Linear through torchao: mode + recipe -> torchao's layer config, the swap, the report.

A Linear does three GEMMs per step (output, grad_input, grad_weight); torchao casts each
operand to FP8 with a dynamic scale just before it. `FP8Config.mode` picks the format of every
cast: e4m3 (3 mantissa bits, max 448: precision), e5m2 (2 mantissa bits, max 57344: range; no
e5m2 x e5m2 GEMM on CUDA, so emulated only), or auto (per layer and role, measured: auto.py;
until calibrated the hybrid: e4m3 forward operands, e5m2 gradients). `FP8Config.recipe` is
torchao's scaling recipe: tensorwise, rowwise, rowwise_with_gw_hp (torchao.float8's
Float8Linear), or mxfp8, mxfp8_wgrad_hp (torchao's MXFP8Linear: e4m3 with one e8m0 scale per
block of 32 values along each GEMM's inner dimension; `EMULATED` kernels off sm_100).

Which layers convert is policy.py's: skip patterns, what the kernels can run, `min_dim`, then
`layers` (faster: only where FP8 beats bf16 at this run's shapes, measured on the GPU; all). A
caller may pass torchao's `module_filter_fn(module, fqn)` instead.

Modules are swapped for `FP8Linear` (torchao's `Float8Linear` plus an `fp8_enabled` switch for
`fp8_disabled`, and an autocast check: FP8 layers run without autocast or under CUDA bf16
autocast only, and say so otherwise), or `MXLinear` (the same around torchao's MXFP8Linear;
both in layers.py). Swapping keeps the same Parameter objects, so optimizer
state, tied weights and state_dict keys are untouched (except with `fsdp_float8_all_gather`:
torchao wraps each weight in a new Parameter, so build the optimizer after converting). Convert
before torch.compile; converting twice with the same recipe and formats is a no-op, and with
others is refused (`_conflict`): the layers would stay as they are while the call looked done.
The reasons and measurements behind each rule: docs/fp8.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterator, Literal

import torch
import torch.nn as nn

from nanochat.fp8 import _torchao  # first: torchao imported with its log noise muted
from torchao.float8.config import Float8LinearConfig, ScalingType
from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear

from nanochat.common import format_table, warn_once
from nanochat.config.fp8 import HYBRID, MX_BLOCK, MX_RECIPES, ROLES, FP8Config
from nanochat.fp8.hardware import FP8Backend, detect, native_gemm_problem
from nanochat.fp8.layers import FP8_LAYER_TYPES, FP8Linear, MXLinear, mx_training_config
from nanochat.fp8.policy import LayerPolicy, ModuleFilter
from nanochat.fp8.speed import Measure

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
"""The two OCP FP8 formats, by the names the API and the CLI use (`mode="e4m3"`)."""
DTYPE_NAMES = {v: k for k, v in FP8_DTYPES.items()}

# Float8LinearConfig's six cast fields, by the role whose tensor each one casts.
CAST_FIELDS = {
    "input": ("cast_config_input", "cast_config_input_for_grad_weight"),
    "weight": ("cast_config_weight", "cast_config_weight_for_grad_input"),
    "grad_output": ("cast_config_grad_output", "cast_config_grad_output_for_grad_weight"),
}


LinConfig = Float8LinearConfig | MXFP8TrainingOpConfig
"""torchao's config of one converted layer: Float8Linear's, or MXFP8Linear's (kernels, wgrad_with_hp)."""


def float8_linear_config(recipe: str, dtypes: dict[str, str], *, emulate: bool,
                         fsdp_float8_all_gather: bool = False) -> Float8LinearConfig:
    """torchao's config for `recipe` with each role's casts retargeted to `dtypes[role]`;
    `fsdp_float8_all_gather` makes Float8Linear.from_float wrap each weight for FSDP2's FP8
    all-gather (torchao's WeightWithDynamicFloat8CastTensor)."""
    base = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(with_dtypes(base, dtypes), emulate=emulate,
                               enable_fsdp_float8_all_gather=fsdp_float8_all_gather)


def with_dtypes(config: Float8LinearConfig, dtypes: dict[str, str]) -> Float8LinearConfig:
    """`config` with both casts of each role targeting that role's FP8 dtype.

    High-precision casts (ScalingType.DISABLED, rowwise_with_gw_hp's grad_weight GEMM) keep
    their scaling type; their target_dtype is set too, only because Float8LinearConfig checks
    that both casts of a role name the same dtype.
    """
    changes = {}
    for role, fields in CAST_FIELDS.items():
        dtype = FP8_DTYPES[dtypes[role]]
        for name in fields:
            changes[name] = dataclasses.replace(getattr(config, name), target_dtype=dtype)
    return dataclasses.replace(config, **changes)


def layer_dtypes(layer: nn.Module) -> dict[str, str]:
    """role -> 'e4m3' / 'e5m2' as the layer's config casts it (MXFP8: e4m3 for every role)."""
    if isinstance(layer, MXFP8Linear):
        return {role: "e4m3" for role in ROLES}
    return {role: DTYPE_NAMES[getattr(layer.config, fields[0]).target_dtype]
            for role, fields in CAST_FIELDS.items()}


@dataclass(frozen=True)
class LayerReport:
    """One nn.Linear of the model and what conversion did with it."""

    name: str
    in_features: int
    out_features: int
    status: Literal["converted", "already FP8", "skipped"]
    reason: str
    """Why it was skipped, or the FP8 format of each role when it runs in FP8."""
    decision: str = ""
    """Why `layers` (or the caller's module_filter_fn) converted it or kept it in bf16: the
    measured fwd+bwd ratio, or the rule that decided. Empty when an earlier rule skipped it."""

    @property
    def flops(self) -> int:
        """GEMM FLOPs per token are 6 * in * out for fwd+bwd; the common factor is dropped."""
        return self.in_features * self.out_features


@dataclass(frozen=True)
class ConversionReport:
    """What `convert` did: per-layer decisions, the backend, and a fallback message if any."""

    layers: tuple[LayerReport, ...]
    backend: Literal["native", "emulated", "fallback"]
    reason: str
    """Why this backend (hardware.detect's reason)."""
    config: FP8Config
    fallback: str | None = None
    """Set when FP8 was requested but cannot run: the line for TrainResult.fallbacks."""
    device_name: str = ""
    layers_fallback: str | None = None
    """Set when `layers` faster could not time the layers (torchao's rule decided): also a line
    for TrainResult.fallbacks."""
    measure_time_s: float = 0.0
    """Seconds `layers` faster spent timing layer shapes (none on a cache hit)."""
    shapes_measured: int = 0
    shapes_cached: int = 0
    kept_by_layers: int = 0
    """Layers that `layers` faster kept in bf16 (all other rules would convert them)."""

    @property
    def converted(self) -> list[str]:
        return [la.name for la in self.layers if la.status == "converted"]

    @property
    def already_converted(self) -> list[str]:
        return [la.name for la in self.layers if la.status == "already FP8"]

    @property
    def skipped(self) -> dict[str, str]:
        return {la.name: la.reason for la in self.layers if la.status == "skipped"}

    @property
    def decisions(self) -> dict[str, str]:
        """layer -> why `layers` (or a module_filter_fn) converted it or kept it in bf16."""
        return {la.name: la.decision for la in self.layers if la.decision}

    @property
    def fp8_flops_share(self) -> float:
        """Fraction of all linear-layer FLOPs that run in FP8 (converted now or before)."""
        total = sum(la.flops for la in self.layers)
        fp8 = sum(la.flops for la in self.layers if la.status != "skipped")
        return fp8 / total if total else 0.0

    def summary(self) -> str:
        n, done, before = len(self.layers), len(self.converted), len(self.already_converted)
        what = f"{done} of {n} linear layers converted"
        if before:
            what += f", {before} already FP8 (nothing to do)"
        timed = ""
        if self.shapes_measured or self.shapes_cached:
            timed = (f"; `layers` faster timed {self.shapes_measured} layer shape(s) in {self.measure_time_s:.1f} s, "
                     f"{self.shapes_cached} from the cache")
        if self.kept_by_layers:
            what += f", {self.kept_by_layers} kept in bf16 by `layers` faster (`layers` all converts them)"
        return (f"FP8 {self.config.mode}/{self.config.recipe}: {what} "
                f"({100 * self.fp8_flops_share:.1f}% of linear FLOPs in FP8), "
                f"backend {self.backend}: {self.reason}{timed}")

    def table(self, text: Callable[[str], str] = str) -> str:
        """Per-layer table; `text` rewrites each reason (a CLI passes one that shows `field` as
        its flag, e.g. nanochat.config.flag_text)."""
        rows = [[la.name, f"{la.in_features}->{la.out_features}", la.status,
                 text(f"{la.reason}; {la.decision}" if la.status == "converted" and la.decision else la.reason)]
                for la in self.layers]
        return format_table(["layer", "shape (in->out)", "fp8", "formats / reason"], rows)


def layers_to_convert(model: nn.Module, config: FP8Config | None = None, *,
                      device: torch.device | str | None = None, module_filter_fn: ModuleFilter | None = None,
                      measure: Measure | None = None, **overrides) -> dict[str, nn.Linear]:
    """name -> the nn.Linear layers `convert(model, config)` would swap for FP8Linear, without
    swapping anything (e.g. to decide `fsdp_float8_all_gather` before converting)."""
    config = _resolve_config(config, overrides)
    device = device if device is not None else _model_device(model)
    hw = detect(device, emulate=config.emulate, recipe=config.recipe)
    policy = LayerPolicy(config, hw, _lin_config(config, hw)[1], device=device, measure=measure,
                         module_filter_fn=module_filter_fn)
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)
            and not isinstance(m, FP8_LAYER_TYPES) and policy.decide(name, m).convert}


def _format_dtypes(dtypes: dict[str, str], config: LinConfig) -> str:
    text = ", ".join(f"{role} {dtypes[role]}" for role in ROLES)
    if isinstance(config, MXFP8TrainingOpConfig):
        text += f", one e8m0 scale per {MX_BLOCK} values"
        high = config.wgrad_with_hp
    else:
        high = any(getattr(config, f).scaling_type is ScalingType.DISABLED
                   for fields in CAST_FIELDS.values() for f in fields)
    return text + (" (grad_weight GEMM in high precision)" if high else "")


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if p.device.type == "meta":
            raise ValueError("the model's parameters are on the meta device: pass convert(..., device=...) "
                             "with the device it will train on")
        return p.device
    raise ValueError("the model has no parameters; there is nothing to convert to FP8")


def _swap(model: nn.Module, replacements: dict[int, nn.Module]) -> None:
    """Point every parent's attribute at the replacement (a module may be registered twice)."""
    for parent in model.modules():
        for key, child in list(parent._modules.items()):
            if child is not None and id(child) in replacements:
                setattr(parent, key, replacements[id(child)])


def _lin_config(config: FP8Config, hw: FP8Backend) -> tuple[dict[str, str], LinConfig, str | None]:
    """The per-role formats the layers get, torchao's config for them, and a fallback line when
    native kernels cannot run `mode` as asked."""
    dtypes, fallback = config.role_dtypes(), None
    if config.recipe in MX_RECIPES:  # e4m3 in every role: FP8Config refuses any other mode
        return dtypes, mx_training_config(config.recipe, emulate=hw.backend != "native"), None
    if hw.backend == "native":
        problem = native_gemm_problem({r: FP8_DTYPES[d] for r, d in dtypes.items()}, recipe=config.recipe)
        if problem:
            # Only all-e5m2 gets here (e4m3 and the hybrid are legal for every recipe). The run
            # goes on with the nearest assignment the kernels accept -- the gradients keep e5m2,
            # input and weight take e4m3 -- and says so, rather than refusing mode e5m2.
            assert native_gemm_problem({r: FP8_DTYPES[d] for r, d in HYBRID.items()}, recipe=config.recipe) is None
            dtypes = dict(HYBRID)
            fallback = (f"fp8: `mode` {config.mode} cannot run as asked on {hw.device_name}: {problem}; "
                        "running input and weight in e4m3 and gradients in e5m2 (the nearest the FP8 "
                        "kernels accept). Set `emulate` for all-e5m2 numerics (slow).")
            warn_once(f"fp8-native-e5m2:{config.recipe}", fallback)
    lin_config = float8_linear_config(config.recipe, dtypes, emulate=hw.backend != "native",
                                      fsdp_float8_all_gather=config.fsdp_float8_all_gather)
    return dtypes, lin_config, fallback


def convert(model: nn.Module, config: FP8Config | None = None, *,
            device: torch.device | str | None = None, module_filter_fn: ModuleFilter | None = None,
            measure: Measure | None = None, **overrides) -> ConversionReport:
    """Swap eligible nn.Linear layers of `model` for FP8Linear, in place, and report.

    `config` is an FP8Config (default FP8Config()); `overrides` replace its fields (`convert(model,
    mode="auto", emulate=True)`). `device` defaults to the device of the model's parameters.
    `module_filter_fn(module, fqn) -> bool` (torchao's signature) replaces the `skip_fqns`,
    `min_dim` and `layers` rules; `measure` replaces the GPU timer of `layers` faster
    (policy.LayerPolicy). The report is also kept on the model: `fp8_report(model)`.
    """
    config = _resolve_config(config, overrides)
    if isinstance(model, nn.Linear):
        raise ValueError("convert() swaps layers inside a model; wrap a bare nn.Linear in a module "
                         "(e.g. nn.Sequential(linear)) to convert it")
    device = device if device is not None else _model_device(model)
    hw = detect(device, emulate=config.emulate, recipe=config.recipe)
    dtypes, lin_config, fallback = _lin_config(config, hw)
    policy = LayerPolicy(config, hw, lin_config, device=device, measure=measure, module_filter_fn=module_filter_fn)

    conflict = _conflict(model, config, lin_config, dtypes)
    if conflict:
        raise ValueError(conflict)
    layers, replacements = _decide_layers(model, policy, lin_config, dtypes)
    nothing = None if hw.backend == "fallback" or replacements else _nothing_converted(layers, config)
    if nothing and config.layers == "all" and module_filter_fn is None and config.converted_layers is None:
        raise ValueError(f"{nothing}: `layers` all asks for every layer; use a model whose Linear shapes fit, "
                         "another `recipe`, or train without FP8")
    if nothing:
        fallback = fallback or nothing
        warn_once(f"fp8-nothing:{config.recipe}:{id(model)}", f"{nothing}; training in high precision")
    if replacements:
        _torchao.prepare_float8_training()  # before anything compiles the converted layers
        _swap(model, replacements)

    if hw.backend == "fallback":
        fallback = f"fp8: {hw.reason}"
        warn_once(f"fp8-fallback:{hw.device_name}", f"FP8 requested but not available: {hw.reason}")
    kept = sum(la.status == "skipped" and bool(la.decision) for la in layers) if module_filter_fn is None else 0
    report = ConversionReport(tuple(layers), hw.backend, hw.reason, config, fallback, hw.device_name,
                              policy.fallback, policy.measure_time_s, policy.shapes_measured, policy.shapes_cached,
                              kept)
    model._nanochat_fp8_report = report
    return report


def _nothing_converted(layers: list[LayerReport], config: FP8Config) -> str | None:
    """Why a conversion asked for converted no layer (the first layer's reason), or None: some
    layer is FP8, or the model has no Linear."""
    if not layers or any(la.status != "skipped" for la in layers):
        return None
    return (f"fp8 {config.mode}/{config.recipe}: none of the model's {len(layers)} Linear layers converts "
            f"(the first, {layers[0].name}: {layers[0].reason})")


def _same_kind(layer: nn.Module, lin_config: LinConfig, dtypes: dict[str, str], mode: str) -> bool:
    """Whether FP8 layer `layer` is what `lin_config` and `dtypes` would make of it (mode auto:
    its formats are calibrated per layer, so only the recipe's scaling counts)."""
    if isinstance(layer, MXFP8Linear) or isinstance(lin_config, MXFP8TrainingOpConfig):
        return (isinstance(layer, MXFP8Linear) and isinstance(lin_config, MXFP8TrainingOpConfig)
                and all(getattr(layer, f) == getattr(lin_config, f)
                        for f in ("kernel_preference", "scale_calculation_mode", "wgrad_with_hp")))
    return (with_dtypes(layer.config, dtypes) == lin_config) and (mode == "auto" or layer_dtypes(layer) == dtypes)


def _conflict(model: nn.Module, config: FP8Config, lin_config: LinConfig, dtypes: dict[str, str]) -> str | None:
    """Why `model`'s FP8 layers cannot count as converted by `config`, or None: a second convert
    with another recipe or mode would otherwise report them "already FP8" unchanged."""
    other = next(((n, m) for n, m in fp8_layers(model).items() if not _same_kind(m, lin_config, dtypes, config.mode)),
                 None)
    if other is None:
        return None
    name, layer = other
    before = fp8_report(model)
    was = (f"{before.config.mode}/{before.config.recipe}" if before is not None else type(layer).__name__)
    formats = ", ".join(f"{r} {d}" for r, d in layer_dtypes(layer).items())
    return (f"convert: the model is already FP8 as {was} (layer {name}: {formats}) "
            f"and this call asks for {config.mode}/{config.recipe}; call restore_fp8(model) first to convert it as "
            f"asked, or convert with {was}")


def _decide_layers(model: nn.Module, policy: LayerPolicy, lin_config, dtypes: dict[str, str]
                   ) -> tuple[list[LayerReport], dict[int, nn.Module]]:
    """Each nn.Linear's report line, and the FP8Linear that replaces each converted one (by id)."""
    layers: list[LayerReport] = []
    replacements: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        if isinstance(module, FP8_LAYER_TYPES):
            reason = ", ".join(f"{r} {d}" for r, d in layer_dtypes(module).items())
            layers.append(LayerReport(name, module.in_features, module.out_features, "already FP8", reason))
            continue
        if not isinstance(module, nn.Linear):
            continue
        decision = policy.decide(name, module)
        why = decision.reason if decision.final_rule else ""
        if not decision.convert:
            layers.append(LayerReport(name, module.in_features, module.out_features, "skipped", decision.reason, why))
            continue
        if isinstance(lin_config, MXFP8TrainingOpConfig):
            new = MXLinear.from_linear(module, lin_config)
        else:
            new = FP8Linear.from_float(module, config=lin_config)
        # the same Parameters, except a weight torchao wrapped for FSDP2's FP8 all-gather (a new
        # Parameter around the same tensor)
        assert new.bias is module.bias and (new.weight is module.weight or policy.config.fsdp_float8_all_gather)
        new.fp8_name = name
        new.train(module.training)
        replacements[id(module)] = new
        layers.append(LayerReport(name, module.in_features, module.out_features, "converted",
                                  _format_dtypes(dtypes, lin_config), why))

    return layers, replacements


def _resolve_config(config: FP8Config | None, overrides: dict) -> FP8Config:
    if config is None:
        config = FP8Config()
    elif not isinstance(config, FP8Config):
        raise TypeError(f"config must be a nanochat.fp8.FP8Config, got {type(config).__name__} "
                        "(a TrainConfig gives its own: cfg.fp8_config())")
    return dataclasses.replace(config, **overrides) if overrides else config


def apply_fp8(model: nn.Module, config: FP8Config | None = None, **overrides) -> nn.Module:
    """`convert` and return the model (for chaining); the report is `fp8_report(model)`."""
    convert(model, config, **overrides)
    return model


def fp8_report(model: nn.Module) -> ConversionReport | None:
    """The report of the last `convert` of this model, or None (never converted, or restored)."""
    return getattr(model, "_nanochat_fp8_report", None)


def fp8_layers(model: nn.Module) -> dict[str, nn.Module]:
    """name -> FP8 layer (FP8Linear or MXLinear, or torchao's Float8Linear or MXFP8Linear converted
    elsewhere)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, FP8_LAYER_TYPES)}


def is_fp8_model(model: nn.Module) -> bool:
    return any(isinstance(m, FP8_LAYER_TYPES) for m in model.modules())


def restore_fp8(model: nn.Module) -> nn.Module:
    """Swap every FP8 layer back to nn.Linear sharing the same Parameters (no copy), in place."""
    if isinstance(model, FP8_LAYER_TYPES):
        raise ValueError(f"restore_fp8() swaps layers inside a model; a bare {type(model).__name__} has no parent")
    replacements = {}
    for module in model.modules():
        if isinstance(module, FP8_LAYER_TYPES):
            with torch.device("meta"):  # no allocation: the parameters are reassigned right away
                plain = nn.Linear(module.in_features, module.out_features, bias=False)
            plain.weight = module.weight
            plain.bias = module.bias
            plain.train(module.training)
            replacements[id(module)] = plain
    _swap(model, replacements)
    model._nanochat_fp8_report = None
    return model


@contextlib.contextmanager
def fp8_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run the block with every FP8Linear in high precision (F.linear); FP8 comes back on exit,
    also when the block raises. Nothing is swapped, so compiled graphs and optimizers stay valid."""
    layers = [m for m in model.modules() if isinstance(m, FP8_LAYER_TYPES)]
    foreign = [m for m in layers if not isinstance(m, (FP8Linear, MXLinear))]
    if foreign:
        raise TypeError(f"fp8_disabled() needs layers converted by nanochat.fp8.convert; found "
                        f"{len(foreign)} torchao {type(foreign[0]).__name__} converted elsewhere. Convert with "
                        "nanochat.fp8.convert, or restore_fp8(model) to leave FP8 for good.")
    previous = [m.fp8_enabled for m in layers]
    for m in layers:
        m.fp8_enabled = False
    try:
        yield model
    finally:
        for m, state in zip(layers, previous):
            m.fp8_enabled = state


__all__ = [
    "FP8Config", "ConversionReport", "LayerReport", "convert", "apply_fp8", "restore_fp8",
    "fp8_disabled", "fp8_report", "fp8_layers", "is_fp8_model", "layers_to_convert", "float8_linear_config",
    "with_dtypes", "layer_dtypes", "ROLES", "FP8_DTYPES", "DTYPE_NAMES", "HYBRID", "LinConfig",
]
