"""asyncio client for a moeline gateway: many requests at once over one connection.

    async with AsyncClient("tcp://127.0.0.1:5555", server_key="gateway.pub") as client:
        result = await client.generate("Once upon a time", max_tokens=32)
        async for event in client.stream("Hello", max_tokens=8):
            print(event.kind, event.text)

The blocking Client does the socket work in one worker thread of its own (a ZeroMQ socket belongs
to one thread): every call goes through that thread, and a pump there reads events and hands each
to its request's queue on the event loop. Requests and their streams may be awaited from any
number of tasks of one event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import AsyncIterator, Dict, Optional, Sequence

from . import Client, Event, ProtocolError, Result, _Collected

# How long the pump holds the worker thread per poll: the most a start() or control() waits.
_POLL_SECONDS = 0.01


class AsyncClient:
    """A connection to a gateway's client endpoint, for asyncio code (see the module's doc)."""

    def __init__(self, endpoint: str, timeout: float = 60.0, api_key: str = "",
                 server_key: str = ""):
        """As Client: api_key where the gateway requires keys, server_key for Curve. timeout: the
        longest a request may stay silent before its stream raises TimeoutError."""
        self.endpoint = endpoint
        self.timeout = timeout
        self._settings = dict(endpoint=endpoint, timeout=timeout, api_key=api_key,
                              server_key=server_key)
        self._worker = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="moeline-client")
        self._client: Optional[Client] = None
        self._queues: Dict[int, asyncio.Queue] = {}
        self._pump: Optional[asyncio.Task] = None

    async def _call(self, function, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, lambda: function(*args, **kwargs))

    async def connect(self) -> "AsyncClient":
        if self._client is None:
            self._client = await self._call(Client, **self._settings)
        return self

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            try:
                await self._pump
            except asyncio.CancelledError:
                pass
            self._pump = None
        if self._client is not None:
            await self._call(self._client.close)
            self._client = None
        self._worker.shutdown(wait=True)

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _require(self) -> Client:
        if self._client is None:
            raise ProtocolError("AsyncClient is not connected (use `async with` or connect())")
        return self._client

    async def _run_pump(self) -> None:
        client = self._require()
        while self._queues:
            event = await self._call(client.poll_event, _POLL_SECONDS)
            if event is None:
                continue
            queue = self._queues.get(event.client_request_id)
            if queue is not None:
                queue.put_nowait(event)

    async def stream(self, prompt: Optional[str] = None, tokens: Optional[Sequence[int]] = None,
                     **params) -> AsyncIterator[Event]:
        """Yields the events of one request, ending with its "finished" or "error" event (the
        parameters are Client.stream's). Leaving the loop early cancels the request."""
        client = self._require()
        queue: asyncio.Queue = asyncio.Queue()

        def start() -> int:
            # In the worker thread, before any later poll there can read the request's events.
            crid = client.start(prompt, tokens, **params)
            self._queues[crid] = queue
            return crid

        crid = await self._call(start)
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run_pump())
        done = False
        try:
            while not done:
                try:
                    event = await asyncio.wait_for(queue.get(), self.timeout)
                except asyncio.TimeoutError:
                    raise TimeoutError(f"no event from {self.endpoint} for request {crid} "
                                       f"within {self.timeout} s") from None
                done = event.terminal
                yield event
        finally:
            self._queues.pop(crid, None)
            if not done and self._client is not None:
                await self._call(self._client.cancel, crid)

    async def generate(self, prompt: Optional[str] = None,
                       tokens: Optional[Sequence[int]] = None, **params) -> Result:
        """Runs one request to the end (Client.generate's parameters). Raises GenerateError on an
        error event."""
        collected = _Collected()
        async for event in self.stream(prompt, tokens, **params):
            result = collected.add(event)
            if result is not None:
                return result
        raise ProtocolError("stream ended without a finished event")

    async def cancel(self, client_request_id: int) -> None:
        await self._call(self._require().cancel, client_request_id)

    async def control(self, command: str, arguments: str = "") -> dict:
        """An operator command ("status", "drain", ...): its reply's JSON."""
        return await self._call(self._require().control, command, arguments)
