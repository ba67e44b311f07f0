"""The FastAPI application: OpenAI routes, health, metrics, tokenizer routes, and error handlers.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id},
GET /health, GET /metrics (Prometheus text), and the tokenizer routes lm-eval's
`local-completions` looks for (GET /tokenizer_info, POST /tokenize, POST /detokenize) so that it
can count tokens with the server's own tokenizer. The engine thread starts and stops with the
application (`app.state.engine`). Any error becomes an OpenAI-shaped JSON error; nothing a client
sends can stop the server. A client that disconnects before its whole (non-streamed) response
is ready cancels the work (`_unless_disconnected`): Starlette does that for streams only.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from ..engine.async_engine import AsyncEngine
from .chat import ChatTemplate
from .errors import APIError, bad_request
from .serving import OpenAIServing

log = logging.getLogger("monodecode.serve")


def build_app(engine: AsyncEngine, model_name: str, tokenizer, chat_template: ChatTemplate) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="monodecode", lifespan=lifespan)
    app.state.engine = engine
    serving = OpenAIServing(engine, model_name, tokenizer, chat_template)
    _add_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _unless_disconnected(request, serving.completions(await _json_body(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _unless_disconnected(request, serving.chat(await _json_body(request)))

    @app.get("/v1/models")
    async def models():
        return serving.models()

    @app.get("/v1/models/{model_id:path}")  # served names may be paths (--model as given)
    async def model(model_id: str):
        return serving.model_card(model_id)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        eos = engine.engine.model.config.eos_token_id
        eos_text = tokenizer.decode([eos]) if tokenizer is not None and eos is not None else None
        return {"eos_token": eos_text or None, "bos_token": None, "pad_token": None,
                "chat_template": chat_template.source, "model_max_length": serving.max_model_len}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return serving.tokenize(await _json_body(request))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return serving.detokenize(await _json_body(request))

    return app


async def _unless_disconnected(request: Request, work):
    """The result of the coroutine `work`, unless the client disconnects first: then `work` is
    cancelled, which aborts its engine requests (AsyncEngine.generate), and the answer is a 499
    that nobody reads. The body has been read, so the next ASGI message is the disconnect."""
    task = asyncio.ensure_future(work)
    disconnect = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait((task, disconnect), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled itself
        task.cancel()  # a no-op once it is done
        disconnect.cancel()
    if task in done:
        return task.result()
    return Response(status_code=499)  # nginx's "client closed request"


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _json_body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request, e: APIError):
        return e.response()

    @app.exception_handler(HTTPException)
    async def http_error(_request, e: HTTPException):
        return APIError(e.status_code, str(e.detail), type="invalid_request_error").response()

    @app.exception_handler(Exception)
    async def unexpected(_request, e: Exception):
        log.exception("unexpected error")
        return JSONResponse(APIError(500, f"internal error: {e!r}", type="server_error").body(), status_code=500)
