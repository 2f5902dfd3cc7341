"""The OpenAI-compatible server (`early-exit-router serve`). Needs the `serve` extra: FastAPI, uvicorn,
prometheus-client and jinja2."""

from __future__ import annotations

from typing import Any


def serve(router: Any, settings: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve `router` over HTTP until interrupted (uvicorn, one worker process: the model is loaded once)."""
    import uvicorn

    from early_exit_router.integrations.server.app import create_app

    uvicorn.run(create_app(router, settings), host=host, port=port, log_level=log_level)
