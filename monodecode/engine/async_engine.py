"""AsyncEngine: an Engine stepped by one background thread, for asyncio callers (the server).

All torch work runs in the engine thread, off the event loop. Callers hand requests and aborts
to it through a thread-safe inbox; it delivers each RequestOutput to the caller's asyncio queue
with `loop.call_soon_threadsafe`. `generate` is an async iterator of a request's outputs; leaving
it early (a client that disconnects, a cancelled task) aborts the request and frees its slot.
A step that raises fails the requests it held, with the error, and the thread goes on. `close`
(the server shutting down) aborts every request at once and refuses new ones, so that their
responses end now instead of after their last tokens.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import AsyncIterator, Callable

from .engine import Engine
from .params import SamplingParams
from .request import RequestOutput

log = logging.getLogger("monodecode.engine")
_STOP = object()


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._deliver: dict[str, Callable[[RequestOutput], None]] = {}  # request id -> delivery to its caller (engine thread only)
        self._thread: threading.Thread | None = None
        self._closed: str | None = None  # why new requests are refused, once closed

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="monodecode-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._inbox.put(_STOP)
            self._thread.join(timeout)
            self._thread = None

    def close(self, reason: str) -> None:
        """Abort every request, each caller getting a last output with `reason` as its error
        (finish reason "abort"), and refuse new ones the same way. Call it on the event loop,
        like `generate`: a request is then either in the inbox before the abort or refused."""
        self._closed = reason
        self._inbox.put(("abort_all", reason))

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine produces them; raises ValueError at once if the
        request cannot run."""
        self.engine.check(prompt_ids, params)
        if self._closed is not None:
            yield RequestOutput(request_id, [], "", finished=True, finish_reason="abort", error=self._closed)
            return
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()

        def deliver(out: RequestOutput) -> None:
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, out)
            except RuntimeError:  # the caller's loop has closed (shutdown)
                pass

        self._inbox.put(("add", request_id, prompt_ids, params, deliver))
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._inbox.put(("abort", request_id))

    def _run(self) -> None:
        while True:
            for item in self._arrivals():
                if item is _STOP:
                    self._fail_all("the server is shutting down", "error")
                    return
                self._handle(item)
            if self.engine.has_work():
                self._step()

    def _arrivals(self) -> list:
        """Everything that has arrived; when the engine is idle, wait for at least one item."""
        items = [] if self.engine.has_work() else [self._inbox.get()]
        while not self._inbox.empty():
            items.append(self._inbox.get_nowait())
        return items

    def _handle(self, item) -> None:
        if item[0] == "abort":
            self.engine.abort(item[1])
            self._deliver.pop(item[1], None)
            return
        if item[0] == "abort_all":
            self._fail_all(item[1], "abort")
            return
        _, request_id, prompt_ids, params, deliver = item
        try:
            self.engine.add_request(request_id, prompt_ids, params)
            self._deliver[request_id] = deliver
        except ValueError as e:
            deliver(RequestOutput(request_id, [], "", finished=True, finish_reason="error", error=str(e)))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - a bad step must not kill the engine thread
            log.exception("engine step failed")
            outputs = self.engine.fail_all(f"engine step failed: {e!r}", "error")
        for out in outputs:
            deliver = self._deliver.pop(out.request_id) if out.finished else self._deliver.get(out.request_id)
            if deliver is not None:
                deliver(out)

    def _fail_all(self, error: str, finish_reason: str) -> None:
        for out in self.engine.fail_all(error, finish_reason):
            deliver = self._deliver.pop(out.request_id, None)
            if deliver is not None:
                deliver(out)
