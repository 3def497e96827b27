"""The engine thread behind the HTTP server: it steps the engine while there is work and hands tokens to asyncio.

Every engine call (submit, cancel, step) runs on this one thread, posted through an inbox and executed between
two steps. So an HTTP handler never blocks the event loop on the engine's lock while a step runs, a new request
joins the running batch at the next step boundary (continuous batching), and a cancel frees its pages before the
next step starts. Tokens travel back into one asyncio queue per request, all of a step's at once: one
`loop.call_soon_threadsafe` per step instead of one per token (each one writes the loop's wake-up pipe; per token
that was ~2% of the engine thread at 8 streams, measured with py-spy).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from oval_edge.runtime.engine.engine import Engine
from oval_edge.runtime.engine.request import QueueFull, Request, RequestRejected
from oval_edge.runtime.engine.sampling import SamplingParams

log = logging.getLogger("oval_edge.server")

# What a ticket's queue carries: ("delta", (text, samples)) for new text, then exactly one ("finish", Request);
# `samples` is how many entries request.samples had then (its logprobs up to this text; the list only grows).
DELTA, FINISH = "delta", "finish"


@dataclass
class Ticket:
    """A handler's view of one submitted request. `events` and `done` live on the handler's event loop."""

    request_id: str
    request: Request
    events: asyncio.Queue
    done: asyncio.Future
    # Why the server (not the client) ended it early, e.g. "the server is shutting down"; None otherwise.
    notes: dict = field(default_factory=dict)

    @property
    def server_note(self) -> str | None:
        return self.notes.get(self.request_id)


class Outbox:
    """Callbacks for event loops, collected on the engine thread and handed over in one call per loop (`flush`)."""

    def __init__(self) -> None:
        self._calls: list[tuple[asyncio.AbstractEventLoop, Callable, tuple]] = []  # engine thread only

    def send(self, loop: asyncio.AbstractEventLoop, callback: Callable, *args) -> None:
        self._calls.append((loop, callback, args))

    def flush(self) -> None:
        calls, self._calls = self._calls, []
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for loop, callback, args in calls:  # order kept per loop: a request's deltas before its finish
            by_loop.setdefault(loop, []).append((callback, args))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_run_all, batch)
            except RuntimeError:  # the loop is already closed: the server is going away
                pass


def _run_all(batch: list[tuple[Callable, tuple]]) -> None:
    for callback, args in batch:
        callback(*args)


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


class EngineLoop:
    """Owns the engine thread. `submit` is awaited on the event loop; `cancel`/`drain`/`stop` may run anywhere."""

    def __init__(self, engine: Engine, idle_poll_s: float = 0.25):
        self.engine = engine
        self.idle_poll_s = idle_poll_s
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._outbox = Outbox()  # flushed after every batch of commands and every step
        self._live: dict[str, Request] = {}  # touched only on the engine thread
        self._notes: dict[str, str] = {}  # request_id -> why the server ended it (read by the handler)
        self._stopping = threading.Event()
        self._pending = 0  # commands posted and not yet finished (so `idle` never misses one being run)
        self._pending_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="oval-edge-engine", daemon=True)

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel whatever still runs (pages freed) and end the thread."""
        if not self._thread.is_alive():
            return
        self.post(lambda: self._cancel_all("the server is shutting down"))
        self.post(self._stopping.set)
        self._thread.join(timeout)

    def drain(self, grace_s: float) -> int:
        """Let running and queued requests finish for up to `grace_s`, then cancel the rest. Returns how many
        were cancelled. Blocking: call it from a plain thread (the SIGTERM path), never on the event loop."""
        deadline = time.monotonic() + max(0.0, grace_s)
        while not self.idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.idle():
            return 0
        cancelled: list[int] = []
        self.post(lambda: cancelled.append(self._cancel_all("the server is shutting down")))
        deadline = time.monotonic() + 5.0
        while not self.idle() and time.monotonic() < deadline:
            time.sleep(0.02)
        return cancelled[0] if cancelled else 0

    def idle(self) -> bool:
        """No command pending and nothing queued or running in the engine."""
        return self._pending == 0 and not self.engine.has_work()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- called from the event loop ---------------------------------------------------------------------------
    async def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                     follows: Request | None = None) -> Ticket:
        """Queue a request in the engine; raises RequestRejected (400) or QueueFull (503) as the engine decides."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        done = loop.create_future()
        accepted = loop.create_future()

        def on_token(request: Request, token_id: int, delta: str) -> None:
            if delta:
                self._outbox.send(loop, events.put_nowait, (DELTA, (delta, len(request.samples))))

        def on_finish(request: Request) -> None:
            self._live.pop(request.request_id, None)
            self._outbox.send(loop, events.put_nowait, (FINISH, request))
            self._outbox.send(loop, _resolve, done, request)

        def do_submit() -> None:
            try:
                request = self.engine.submit(prompt_ids, params, request_id, on_token, on_finish, follows)
            except (RequestRejected, QueueFull) as exc:
                self._outbox.send(loop, _resolve, accepted, exc)
                return
            except Exception as exc:  # noqa: BLE001 - reported to the one handler that asked, not fatal
                log.exception("submit of %s failed", request_id)
                self._outbox.send(loop, _resolve, accepted, RuntimeError(f"{type(exc).__name__}: {exc}"))
                return
            self._live[request_id] = request
            self._outbox.send(loop, _resolve, accepted, request)

        self.post(do_submit)
        try:
            result = await accepted
        except asyncio.CancelledError:  # the client left before the engine took it: do not run it for nobody
            self.cancel(request_id)
            raise
        if isinstance(result, BaseException):
            raise result
        return Ticket(request_id, result, events, done, self._notes)

    def cancel(self, request_id: str) -> None:
        """Stop a request at the next step boundary and free its pages (thread-safe, non-blocking)."""
        self.post(lambda: self.engine.cancel(request_id))

    def forget(self, request_id: str) -> None:
        """Drop the server's note for a finished request (the handler has read it)."""
        self._notes.pop(request_id, None)

    # ---- the engine thread ----------------------------------------------------------------------------------
    def post(self, command: Callable[[], None]) -> None:
        """Run `command` on the engine thread before its next step (thread-safe, non-blocking); an exception it
        raises is logged and the thread goes on."""
        with self._pending_lock:
            self._pending += 1
        self._inbox.put(command)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._run_commands(block=not self.engine.has_work())
                self._outbox.flush()
                if self._stopping.is_set():
                    break
                if self.engine.has_work():
                    try:
                        self.engine.step()
                    except Exception as exc:  # noqa: BLE001 - keep serving; fail only the requests in flight
                        log.exception("engine step failed")
                        self._cancel_all(f"the engine failed: {type(exc).__name__}: {exc}")
                    self._outbox.flush()
        finally:
            self._outbox.flush()

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=self.idle_poll_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                command()
            except Exception:  # noqa: BLE001 - a failing command must not end the engine thread
                log.exception("engine command failed")
            finally:
                with self._pending_lock:
                    self._pending -= 1
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _cancel_all(self, why: str) -> int:
        count = 0
        for request_id in list(self._live):
            self._notes[request_id] = why
            if self.engine.cancel(request_id):
                count += 1
            self._live.pop(request_id, None)
        return count
