"""The error every server module raises for a request it will not serve: an HTTP status and
OpenAI's error body (kept apart from protocol.py so that jsonbody.py and request_fields.py, which
protocol.py uses, can raise it too without an import circle)."""
from __future__ import annotations

from typing import Any, Mapping


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        message, param = _printable(message), None if param is None else _printable(param)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                              405: "invalid_request_error",
                              409: "conflict_error", 413: "invalid_request_error",
                              429: "rate_limit_error", 503: "service_unavailable"}.get(status, "server_error")
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    """400: the request's field `param` holds a value this server will not take."""
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def _printable(text: str, limit: int = 1000) -> str:
    """Error text as a client can always receive it: lone surrogates escaped (UTF-8 cannot carry
    them), a value quoted from a huge request cut short."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[:limit] + "..."
