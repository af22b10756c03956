from __future__ import annotations

from aiohttp import web


class ProxyError(Exception):
    """An answer for the client: an HTTP status and a message that names the cause."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}

    def body(self) -> dict:
        """The OpenAI-style error object the client gets."""
        kind = "BadRequestError" if self.status < 500 else "UpstreamError"
        return {"error": {"message": self.message, "type": kind, "code": self.status}}

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        headers = self.headers | (headers or {})
        return web.json_response(self.body(), status=self.status, headers=headers)
