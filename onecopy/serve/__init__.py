"""An OpenAI-compatible HTTP server on the engine's scheduler (`onecopy serve`)."""

from .app import ServerConfig, create_app
from .server import BackgroundServer, serve

__all__ = ["BackgroundServer", "ServerConfig", "create_app", "serve"]
