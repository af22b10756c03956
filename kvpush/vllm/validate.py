"""ASGI middleware for a kvpush engine: a bad `kv_transfer_params` gets a 400 naming the field.

Without it vLLM can only fail such a request as a KV load failure (HTTP 500 with fixed text).
Load it with `--middleware kvpush.vllm.validate.ValidateMiddleware` (`kvpush serve` does).
"""

from __future__ import annotations

import json
from typing import Any

from kvpush import logs
from kvpush.asgi import ClientGone, read_body, replay, respond
from kvpush.vllm.params import ParamsError, parse

_CHECKED_PATHS = ("/v1/completions", "/v1/chat/completions")


def check_body(body: dict[str, Any]) -> str | None:
    """The error message for a request kvpush cannot serve, or None."""
    try:
        params = parse(body.get("kv_transfer_params"))
    except ParamsError as e:
        return str(e)
    if params is None:
        return None
    n = body.get("n", 1)
    if n != 1:
        return f"n={n}: push mode serves one sequence per request; send n=1"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return (
            f"push mode takes one prompt per request, got a list of {len(prompt)}; "
            "send each prompt as its own request"
        )
    return None


class ValidateMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app
        logs.attach()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in _CHECKED_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            raw = await read_body(receive)
        except ClientGone:
            return
        error = None
        try:
            body = json.loads(raw or b"{}")
            if isinstance(body, dict):
                error = check_body(body)
        except ValueError:
            pass  # vLLM answers malformed JSON itself
        if error is not None:
            payload = {"error": {"message": error, "type": "BadRequestError", "code": 400}}
            await respond(send, 400, json.dumps(payload).encode())
            return
        await self.app(scope, replay(raw, receive), send)
