"""The decode deployment of kvpush's Ray Serve app: Ray's P/D orchestrator, and no request lost
to a dying prefill replica.

Ray 2.60's decode server (`ray.serve.llm.deployment.PDDecodeServer`) runs each request's
prefill on a prefill replica and its decode on its own engine, at once for kvpush (see
kvpush.ray.backend). When the prefill replica dies mid-request, Ray raises the replica's
death through the decode stream and the client gets 500, though the decode engine could
compute the prompt itself. `KVPushDecodeServer` keeps Ray's orchestration and catches that:
a request whose orchestrated answer fails before its first chunk is served whole on this
decode engine, as a plain request (kvpush's proxy does the same, `Dispatcher._local`).

Once a chunk went out the request is lost, and the client is told: an error event ends the
stream. Ray's orchestrator raises the prefill replica's death even after decode has begun
streaming (the prefill leg's answer can still be on its way back through Ray when decode's
first chunk goes out), and Ray's ingress then ends the stream with neither an error event
nor `[DONE]`: a client would take the truncated answer for a whole one.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import Any

from ray.serve.llm.deployment import LLMServer, PDDecodeServer
from ray.serve.llm.openai_api_models import ErrorResponse

log = logging.getLogger(__name__)


class KVPushDecodeServer(PDDecodeServer):
    async def completions(self, request: Any, raw_request_info: Any = None) -> AsyncGenerator:
        answer = await super().completions(request, raw_request_info)
        return self._or_whole("completions", request, raw_request_info, answer)

    async def chat(self, request: Any, raw_request_info: Any = None) -> AsyncGenerator:
        answer = await super().chat(request, raw_request_info)
        return self._or_whole("chat", request, raw_request_info, answer)

    async def _or_whole(
        self, method: str, request: Any, raw_request_info: Any, answer: AsyncGenerator
    ) -> AsyncGenerator:
        sent = False
        try:
            async for chunk in answer:
                sent = True
                yield chunk
            return
        except Exception as e:
            if sent:
                log.error(
                    "request %s: failed mid-stream: %s: %s",
                    request_id(request),
                    type(e).__name__,
                    e,
                )
                yield ErrorResponse.model_validate(
                    {
                        "error": {
                            "message": f"the answer failed mid-stream: {type(e).__name__}: {e}",
                            "type": "InternalServerError",
                            "code": 500,
                        }
                    }
                )
                return
            log.warning(
                "request %s: prefill and decode failed before a byte (%s: %s); serving it "
                "whole on this decode engine",
                request_id(request),
                type(e).__name__,
                e,
            )
        # LLMServer's own method: this engine alone, the request as the client sent it
        whole = await getattr(LLMServer, method)(self, request, raw_request_info)
        async for chunk in whole:
            yield chunk


def request_id(request: Any) -> str:
    return str(getattr(request, "request_id", "?"))
