"""`pagedecode serve`: an OpenAI-compatible HTTP server over an AsyncEngine (starlette + uvicorn).

    from pagedecode.server import build_app      # the ASGI app, to mount in your own server
"""
from .app import build_app
from .protocol import ApiError, Limits

__all__ = ["ApiError", "Limits", "build_app", "serve"]


def serve(argv: list[str] | None = None) -> int:
    from .serve import main
    return main(argv)
