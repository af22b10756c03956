from __future__ import annotations

from fastapi.responses import JSONResponse


class ProxyError(Exception):
    """An answer for the client: an HTTP status and a message that names the cause."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}

    def response(self) -> JSONResponse:
        kind = "BadRequestError" if self.status < 500 else "UpstreamError"
        body = {"error": {"message": self.message, "type": kind, "code": self.status}}
        return JSONResponse(body, self.status, headers=self.headers)
