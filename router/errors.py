"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the right HTTP status."""

from __future__ import annotations

from starlette.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = _utf8(message)  # messages quote what the client sent, lone surrogates included
        self.param = param if param is None else _utf8(param)
        self.type = type_ or {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
                              415: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
                              500: "internal_error"}.get(status, "api_error")
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _utf8(text: str) -> str:
    """`text` with any lone surrogate written as its escape, so that it encodes as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code=code)
