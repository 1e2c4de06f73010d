"""Training: data and tokenizer (data), the small target LM (target_lm), DFlash/DSpark drafters (trainer)."""

from blockspec.train.trainer import DrafterTrainConfig, TrainResult, train_drafter

__all__ = ["DrafterTrainConfig", "TrainResult", "train_drafter"]
