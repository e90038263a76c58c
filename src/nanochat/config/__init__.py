"""Every entrypoint's configuration: one frozen dataclass each, the single source of `--help`.

tyro turns these dataclasses into CLIs, the attribute docstring under each field becomes its help
text, `NanoChatTrainer(**kwargs)` takes the same field names, and checkpoints store the config
as a plain dict (`dataclasses.asdict`) so a run can be resumed and inspected without unpickling.

    from nanochat.config import TrainConfig, parse_cli
    cfg = parse_cli(TrainConfig, argv)     # every rejection one `error:` line, exit status 2

TrainConfig (base_train, NanoChatTrainer), FP8Config, ExportConfig, GPUCheckConfig and the tools'
configs are assembled from shared field groups (each flag declared once, the FP8 flags generated
from FP8Config) and check their types and ranges at construction, from the CLI or Python alike.
A benchmark's flags live with it in bench/, built from the same field groups where it shares them.

This package imports nothing of ours but nanochat.common, and no torch: every script's `--help`
answers without loading torch. Constants a flag defaults to (the export's SQNR floor, the plot's
row limit) live here and the code above uses them.
"""

from nanochat.config.cli import parse_cli
from nanochat.config.export import SQNR_FLOOR_DB, ExportConfig, Quantize
from nanochat.config.fields import (
    FP8_FLAGS, BatchFields, DataFields, DeviceFields, FP8Fields, ModelFields, ScheduleFields, ScriptFields,
    SourceFields, flag_text, flags_in_log,
)
from nanochat.config.fp8 import FP8Config
from nanochat.config.tools import MAX_ROWS, EvalConfig, PlotConfig, TokenizeConfig, TokTrainConfig
from nanochat.config.train import RESUME_MUST_MATCH, LogChoice, TrainConfig

__all__ = [
    "FP8_FLAGS", "MAX_ROWS", "RESUME_MUST_MATCH", "SQNR_FLOOR_DB", "BatchFields", "DataFields",
    "DeviceFields", "EvalConfig", "ExportConfig", "FP8Config", "FP8Fields", "LogChoice", "ModelFields",
    "PlotConfig", "Quantize", "ScheduleFields", "ScriptFields", "SourceFields", "TokTrainConfig",
    "TokenizeConfig", "TrainConfig", "flag_text", "flags_in_log", "parse_cli",
]
