"""The engine: continuous batching of requests on one model (engine.py), driven by one background
thread for asyncio servers (async_engine.py)."""

from .async_engine import AsyncEngine
from .engine import Engine
from .metrics import Metrics
from .params import SamplingParams
from .request import RequestOutput
from .tokenizer import load_tokenizer

__all__ = ["AsyncEngine", "Engine", "Metrics", "RequestOutput", "SamplingParams", "load_tokenizer"]
