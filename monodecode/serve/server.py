"""`monodecode serve`: load the model, build the engine and the app, run uvicorn."""

from __future__ import annotations

import logging

from ..engine import AsyncEngine, Engine, load_tokenizer
from ..mono import check_mode as check_mono
from ..spec.config import SpeculativeConfig
from .app import build_app
from .chat import ChatTemplate

DEFAULT_MAX_MODEL_LEN = 4096


def make_app(model, source: str, *, max_model_len: int | None = None, max_num_seqs: int = 8,
             max_num_batched_tokens: int = 512, speculative_config: str | dict | None = None,
             mono: str = "auto", served_model_name: str | None = None, warm_up: bool = False):
    """The app for `model` (loaded from `source`, a checkpoint directory or preset name); with
    `warm_up`, every decode width is compiled and captured before the app exists (`Engine.warm_up`)."""
    tokenizer = load_tokenizer(source, model.config.vocab_size)
    max_model_len = max_model_len or min(DEFAULT_MAX_MODEL_LEN, model.config.max_position_embeddings)
    spec = SpeculativeConfig.from_json(speculative_config) if speculative_config else None
    engine = Engine(model, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens, speculative=spec, mono=mono, tokenizer=tokenizer)
    if warm_up:
        engine.warm_up()
    return build_app(AsyncEngine(engine), served_model_name or str(source), tokenizer, ChatTemplate(source))


def serve(args) -> int:
    import torch
    import uvicorn

    from ..model import load_model

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    check_mono(args.mono)  # before spending time on loading the model
    model = load_model(args.model, device=args.device, dtype=getattr(torch, args.dtype))
    app = make_app(model, args.model, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, speculative_config=args.speculative_config,
                   mono=args.mono, served_model_name=args.served_model_name,
                   warm_up=model.device.type == "cuda")  # a CPU has no graphs to capture
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
