"""`monodecode serve`: check the flags, bind the port, load the model, build the engine and the
app, run uvicorn. What can fail fast (a port in use, --max-model-len beyond the model) fails
before the model loads. On SIGTERM or Ctrl-C the running requests are aborted first (503), so
the server exits within a few seconds instead of after their last tokens.
"""

from __future__ import annotations

import logging
import socket

import uvicorn

from ..engine import AsyncEngine, Engine, load_tokenizer
from ..mono import check_mode as check_mono
from ..spec.config import SpeculativeConfig
from .app import build_app
from .chat import ChatTemplate

log = logging.getLogger("monodecode.serve")
DEFAULT_MAX_MODEL_LEN = 4096
SHUTDOWN_REASON = "the server is shutting down"


def make_app(model, source: str, *, max_model_len: int | None = None, max_num_seqs: int = 8,
             max_num_batched_tokens: int = 512,
             speculative_config: SpeculativeConfig | str | dict | None = None, mono: str = "auto",
             served_model_name: str | None = None, warm_up: bool = False):
    """The app for `model` (loaded from `source`, a checkpoint directory or preset name); with
    `warm_up`, every decode width is compiled and captured before the app exists (`Engine.warm_up`)."""
    tokenizer = load_tokenizer(source, model.config.vocab_size)
    max_model_len = resolve_max_model_len(model.config, source, max_model_len)
    spec = speculative_config
    if spec is not None and not isinstance(spec, SpeculativeConfig):
        spec = SpeculativeConfig.from_json(spec)
    engine = Engine(model, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens, speculative=spec, mono=mono, tokenizer=tokenizer)
    if warm_up:
        engine.warm_up()
    return build_app(AsyncEngine(engine), served_model_name or str(source), tokenizer, ChatTemplate(source))


def resolve_max_model_len(config, source: str, requested: int | None) -> int:
    """`requested`, or the default; refused beyond the positions the model was made for."""
    if requested is None:
        return min(DEFAULT_MAX_MODEL_LEN, config.max_position_embeddings)
    if requested > config.max_position_embeddings:
        raise ValueError(f"max_model_len (--max-model-len) {requested} is beyond {source}'s "
                         f"max_position_embeddings, {config.max_position_embeddings}")
    return requested


class Server(uvicorn.Server):
    """uvicorn that aborts the engine's requests as its shutdown begins: uvicorn waits for every
    open response before it lets the application stop, and a long request would hold it."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine):
        super().__init__(config)
        self.engine = engine

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        for sock in sockets or []:  # uvicorn logs where it listens only for sockets it opened itself
            host, port = sock.getsockname()[:2]
            log.info("listening on http://%s:%d (Ctrl-C or SIGTERM to stop)", f"[{host}]" if ":" in host else host, port)

    async def shutdown(self, sockets=None) -> None:
        self.engine.close(SHUTDOWN_REASON)
        await super().shutdown(sockets)


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, or ValueError saying why not (e.g. the port is in use)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise ValueError(f"--host {host}: cannot listen there ({e})") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restarts reuse the port
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None
    return sock


def serve(args) -> int:
    import torch

    from ..config import load_config
    from ..decode import load_any

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    check_mono(args.mono)  # before spending time on loading the model
    max_model_len = resolve_max_model_len(load_config(args.model), args.model, args.max_model_len)
    sock = bind(args.host, args.port)
    try:
        model = load_any(args.model, device=args.device, dtype=getattr(torch, args.dtype),
                         tensor_parallel_size=args.tensor_parallel_size)
        app = make_app(model, args.model, max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       speculative_config=args.speculative_config, mono=args.mono,
                       served_model_name=args.served_model_name,
                       warm_up=model.device.type == "cuda")  # a CPU has no graphs to capture
        Server(uvicorn.Config(app, log_level="info"), app.state.engine).run(sockets=[sock])
    finally:
        sock.close()
    return 0
