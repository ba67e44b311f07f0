"""The per-op path: the reference DeepSeek-V4 implementation in plain PyTorch."""

from .cache import DecodeCache
from .transformer import Model, load_model

__all__ = ["DecodeCache", "Model", "load_model"]
