"""Sample models for scalescope: a small GPT decoder and an MLP, in plain JAX + optax."""

from .gpt import (
    GPTConfig,
    gpt_forward,
    gpt_loss,
    init_gpt,
    stack_blocks,
    unstack_blocks,
)
from .losses import cross_entropy
from .mlp import MLPConfig, init_mlp, mlp_accuracy, mlp_forward, mlp_loss
from .precision import PRECISIONS, Precision, get_precision
from .train_step import make_optimizer, make_train_step

__all__ = [
    "PRECISIONS",
    "GPTConfig",
    "MLPConfig",
    "Precision",
    "cross_entropy",
    "get_precision",
    "gpt_forward",
    "gpt_loss",
    "init_gpt",
    "init_mlp",
    "make_optimizer",
    "make_train_step",
    "mlp_accuracy",
    "mlp_forward",
    "mlp_loss",
    "stack_blocks",
    "unstack_blocks",
]
