"""monodecode: fast low-concurrency decoding of DeepSeek-V4-family MoE models (Python + Triton)."""

from .checkpoint import Checkpoint, CheckpointError, write_synthetic_checkpoint
from .config import ConfigError, ModelConfig, load_config, preset
from .decode import Decoder, load
from .model import Model

__version__ = "0.1.0"
__all__ = [
    "Checkpoint", "CheckpointError", "ConfigError", "Decoder", "Model", "ModelConfig", "load", "load_config", "preset",
    "write_synthetic_checkpoint",
]
