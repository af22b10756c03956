"""A streamed answer copied to the client, whatever the front (the proxy's aiohttp.web
handler, or the front end's ASGI middleware): the start and write callables are the front's,
and so are the bytes' way out."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kvpush.proxy.dispatch import DONE, Answer, LegError, sse_error

log = logging.getLogger(__name__)


async def relay(
    answer: Answer,
    start: Callable[[], Awaitable[Any]],
    write: Callable[[bytes], Awaitable[Any]],
) -> None:
    """Copy a streamed answer to the client; `finish` runs once, however it ends. A decode
    failure mid-stream ends the stream with an error event."""
    trace, finished, skip = answer.trace, answer.stream is None, answer.skip
    num_chunks = 0 if skip is not None else 1
    try:
        await start()
        await write(answer.first)
        if answer.stream is None:  # prefill's token was the whole answer
            return
        chunks = answer.stream.content.iter_any().__aiter__()
        while not finished:
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:  # decode ended its stream: complete
                finished = True
                break
            except (LegError, TimeoutError) as e:
                log.warning("decode's stream failed mid-answer: %r", e)
                await write(sse_error(502, f"decode engine failed mid-stream: {e!r}"))
                break
            num_chunks += 1
            if skip is None:
                await write(chunk)
            else:
                if num_chunks == 1:
                    trace.mark("first_chunk")
                if data := skip.feed(chunk):
                    await write(data)
            # The answer is complete: a client may close its connection the moment it
            # reads this, before decode's stream ends.
            finished = chunk.endswith(DONE)
        if finished:
            trace.mark("last_chunk")
        trace.num_chunks = num_chunks
    finally:
        answer.finish(finished)
