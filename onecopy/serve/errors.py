"""OpenAI-style error objects: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

from __future__ import annotations

from typing import Any

from ..errors import EngineFailedError


class APIError(Exception):
    """An error a client gets as JSON, with the status, type and code the OpenAI API uses for it."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, what: str) -> APIError:
    return APIError(400, f"{what} is not supported by this server; remove '{param}' from the request", param=param,
                    code="unsupported_parameter")


def unavailable(error: Exception) -> APIError:
    """503 for an engine that serves no more: failed (its message names a log reference, never the raw
    error) or closed."""
    code = "engine_failed" if isinstance(error, EngineFailedError) else "engine_unavailable"
    return APIError(503, str(error), type="server_error", code=code)
