"""`from nanochat.trainer import NanoChatTrainer`: the trainer's public name, kept where users
import it; the loop and its parts live in nanochat.train."""

from nanochat.train.trainer import NanoChatTrainer, TrainResult, lr_multiplier

__all__ = ["NanoChatTrainer", "TrainResult", "lr_multiplier"]
