from __future__ import annotations

from aiohttp import web


class ProxyError(Exception):
    """An answer for the client: an HTTP status and a message that names the cause."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        kind = "BadRequestError" if self.status < 500 else "UpstreamError"
        body = {"error": {"message": self.message, "type": kind, "code": self.status}}
        return web.json_response(body, status=self.status, headers=self.headers | (headers or {}))
