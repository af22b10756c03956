"""The decode deployment of kvpush's Ray Serve app: Ray's P/D orchestrator, and no request lost
to a dying prefill replica.

Ray 2.60's decode server (`ray.serve.llm.deployment.PDDecodeServer`) runs each request's
prefill on a prefill replica and its decode on its own engine, at once for kvpush (see
kvpush.ray.backend). When the prefill replica dies mid-request, Ray raises the replica's
death through the decode stream and the client gets 500, though the decode engine could
compute the prompt itself. `KVPushDecodeServer` keeps Ray's orchestration and catches that:
a request whose orchestrated answer fails before its first chunk is served whole on this
decode engine, as a plain request (kvpush's proxy does the same, `Dispatcher._local`). Once
a chunk went out, the failure is the client's, as before.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import Any

from ray.serve.llm.deployment import LLMServer, PDDecodeServer

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
                raise
            log.warning(
                "request %s: prefill and decode failed before a byte (%s: %s); serving it "
                "whole on this decode engine",
                getattr(request, "request_id", "?"),
                type(e).__name__,
                e,
            )
        # LLMServer's own method: this engine alone, the request as the client sent it
        whole = await getattr(LLMServer, method)(self, request, raw_request_info)
        async for chunk in whole:
            yield chunk
