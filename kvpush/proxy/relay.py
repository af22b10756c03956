"""A streamed answer copied to the client, whatever the front (the proxy's aiohttp.web
handler, or the front end's ASGI middleware): the start and write callables are the front's,
and so are the bytes' way out."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kvpush.proxy.dispatch import DONE, sse_error
from kvpush.proxy.legs import Answer, LegError, LegTimeout

log = logging.getLogger(__name__)
Write = Callable[[bytes], Awaitable[Any]]


class Failed(Exception):
    """The stream's engine failed mid-answer: `cause` as kvpush_proxy_migrated counts it."""

    def __init__(self, cause: str, error: BaseException | None = None) -> None:
        super().__init__(cause)
        self.cause, self.error = cause, error


async def relay(answer: Answer, start: Callable[[], Awaitable[Any]], write: Write) -> None:
    """Copy a streamed answer to the client; each answer's `finish` runs once, however it
    ends. When its engine fails mid-answer the stream goes on from another engine where the
    dispatcher can continue it (`Answer.resume`, kvpush.proxy.migrate), else it ends with an
    error event."""
    trace, finished = answer.trace, False
    trace.num_chunks = 0 if answer.skip is not None else 1
    try:
        await start()
        while True:
            try:
                await _copy(answer, write)
            except Failed as failure:
                answer.finish(False, ended=False)  # the failed leg closes first
                resumed = None
                if answer.resume is not None:
                    resumed = await answer.resume(failure.cause, failure.error)
                if resumed is None:
                    reason = failure.error or (answer.progress and answer.progress.error)
                    message = f"decode engine failed mid-stream ({failure.cause}): " + (
                        repr(reason) if reason else "its stream ended before [DONE]"
                    )
                    log.warning("%s", message)
                    await write(sse_error(502, message))
                    return
                answer = resumed
                continue
            finished = True
            trace.mark("last_chunk")
            return
    finally:
        answer.finish(finished)


async def _copy(answer: Answer, write: Write) -> None:
    """One engine's stream, to its end; Failed if it fails first."""
    trace, skip, progress = answer.trace, answer.skip, answer.progress

    async def out(data: bytes) -> None:
        if progress is not None:
            data = progress.feed(data)
        if data:
            await write(data)

    await out(answer.first)
    if answer.stream is None:  # prefill's token was the whole answer, or the end was all left
        return
    chunks = answer.stream.content.iter_any().__aiter__()
    while True:
        try:
            if answer.prefill_down is not None and trace.num_chunks == 0:
                chunk = await _unless_down(chunks.__anext__(), answer.prefill_down)
            else:
                chunk = await chunks.__anext__()
        except StopAsyncIteration:
            if progress is not None and not progress.done:
                raise Failed("ended") from None
            return  # decode ended its stream
        except LegTimeout as e:
            raise Failed("timeout", e) from e
        except (LegError, TimeoutError) as e:
            raise Failed("broken", e) from e
        trace.num_chunks += 1
        if skip is None:
            data = chunk
        else:
            if trace.num_chunks == 1:
                trace.mark("first_chunk")
            data = skip.feed(chunk)
        await out(data)
        if progress is not None:
            if progress.error:
                raise Failed("error")
            if progress.done:
                return
        elif chunk.endswith(DONE):
            # The answer is complete: a client may close its connection the moment it
            # reads this, before decode's stream ends.
            return


async def _unless_down(read: Awaitable[bytes], down: asyncio.Event) -> bytes:
    """Decode's first chunk of a pushed stream, unless its prefill engine is lost first:
    then its KV may never come, and decode would learn so only from its own liveness check
    (seconds later). Failed("prefill") then moves the stream on at once, from the first
    token the client has."""
    reading = asyncio.ensure_future(read)
    waiting = asyncio.ensure_future(down.wait())
    try:
        await asyncio.wait((reading, waiting), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the client went away meanwhile
        reading.cancel()
        raise
    finally:
        waiting.cancel()
    if reading.done():
        return reading.result()
    reading.cancel()
    raise Failed("prefill")
