"""``localrun serve``: an OpenAI- and Ollama-compatible HTTP server over localrun.

    from localrun.server import ServerConfig, create_app
    app = create_app(ServerConfig(models=("smollm2:135m",)))   # an ASGI app (FastAPI)

Needs the ``serve`` extra (FastAPI, uvicorn, prometheus-client):
``pip install -e '.[serve]'`` in a clone, ``pip install 'localrun-llm[serve]'`` from a
wheel (as ``localrun.install.pip_install`` says). Layout: ``config`` (settings, the
default port), ``manager`` (loaded models, keep-alive, LRU unload, admission queue),
``jobs`` (one request's run: worker thread, deadline, disconnect), ``openai_api`` and
``ollama_api`` (the routes), ``embeddings``, ``metrics``, ``app`` (middleware, the uvicorn
server).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from localrun.server.config import DEFAULT_PORT, ServerConfig, parse_duration

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["DEFAULT_PORT", "ServerConfig", "create_app", "parse_duration"]


def create_app(config: ServerConfig, **kwargs: Any) -> FastAPI:
    from localrun.server.app import create_app as make

    return make(config, **kwargs)
