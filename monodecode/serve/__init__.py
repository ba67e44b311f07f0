"""The OpenAI-compatible server (`monodecode serve`): FastAPI + uvicorn on an AsyncEngine."""

from .server import make_app, serve

__all__ = ["make_app", "serve"]
