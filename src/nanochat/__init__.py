"""nanochat: a small, readable LLM training framework built around FP8 training done right.

Public API:
    from nanochat.trainer import NanoChatTrainer, TrainResult   # the training loop
    from nanochat.config import TrainConfig                     # every flag, one dataclass
    from nanochat.fp8 import FP8Config, FP8Training             # FP8 for anyone's own loop

`NanoChatTrainer`, `TrainResult` and `TrainConfig` are also reachable as `nanochat.X`; they are
imported lazily so that `import nanochat.fp8` stays light (it must not pull in the trainer).
"""

__version__ = "0.1.0"
__all__ = ["NanoChatTrainer", "TrainResult", "TrainConfig", "__version__"]


def __getattr__(name: str):
    if name in ("NanoChatTrainer", "TrainResult"):
        from nanochat.train import trainer

        return getattr(trainer, name)
    if name == "TrainConfig":
        from nanochat.config import TrainConfig

        return TrainConfig
    raise AttributeError(f"module 'nanochat' has no attribute {name!r}")
