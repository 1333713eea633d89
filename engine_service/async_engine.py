"""The engine loop: one thread owns the ``LLMEngine``; asyncio code talks to it by commands.

The ``LLMEngine`` is not thread-safe, so it lives on one background thread (the actor): gRPC
handlers send it add / abort commands through a thread-safe queue; the thread drains the
commands, runs ``step()`` and hands every request's outputs to its ``RequestStream`` with one
``loop.call_soon_threadsafe`` per step. Nothing the event loop does can delay a step, and a slow
reader cannot hold KV blocks: a stream that falls ``max_stream_buffer`` outputs behind is cut off
and its request aborted. When there is no work the thread blocks on the command queue.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from engine_service.config import EngineConfig
from engine_service.llm_engine import LLMEngine
from engine_service.metrics import EngineMetrics
from engine_service.model_loader import load_tokenizer
from engine_service.outputs import RequestOutput
from engine_service.sampling_params import SamplingParams

logger = structlog.get_logger("pagoda.engine_loop")

RATE_WINDOW_S = 10.0  # output tokens/s in GetLoad is measured over this window


class EngineUnavailable(Exception):
    """The engine cannot take requests: loading, stopped, or its loop died."""


class DuplicateRequestId(Exception):
    """A live request already has this request_id."""


class QueueFull(Exception):
    """The waiting queue is at ``max_waiting_requests``."""


class StreamOverrun(Exception):
    """The stream's reader fell ``max_stream_buffer`` outputs behind; the request was aborted."""


@dataclass(frozen=True)
class LoadSnapshot:
    """The engine's load after its latest step, published by the loop thread for any reader."""

    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_running_requests: int = 0
    num_waiting_requests: int = 0
    num_waiting_prompt_tokens: int = 0
    recent_tokens: tuple[tuple[float, int], ...] = ()  # (monotonic time, tokens generated) per step

    def output_tokens_per_s(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        return sum(n for t, n in self.recent_tokens if now - t <= RATE_WINDOW_S) / RATE_WINDOW_S


class RequestStream:
    """One request's outputs, pushed by the engine loop and read by one asyncio consumer.

    ``get()`` returns every output buffered since the previous call (so a consumer that fell
    behind catches up in one message) and raises the stream's error once it is cut off.
    """

    def __init__(self, request_id: str, max_buffer: int, on_overrun: Callable[["RequestStream"], None]):
        self.request_id = request_id
        self.finished = False  # the last output was pushed (or the request was aborted)
        self.error: Exception | None = None
        self.consumer: asyncio.Task | None = asyncio.current_task()
        self._max_buffer = max_buffer
        self._on_overrun = on_overrun
        self._buffer: deque[RequestOutput] = deque()
        self._event = asyncio.Event()
        self._reading = False
        self.last_output_time: float | None = None  # engine thread only: inter-token latency

    async def get(self) -> list[RequestOutput]:
        while not self._buffer:
            if self.error is not None:
                raise self.error
            if self.finished:
                return []
            self._event.clear()
            self._reading = True
            try:
                await self._event.wait()
            finally:
                self._reading = False
        outputs = list(self._buffer)
        self._buffer.clear()
        return outputs

    def _push(self, output: RequestOutput) -> None:
        if self.error is not None or self.finished:
            return
        self._buffer.append(output)
        if output.finished:
            self.finished = True
        elif len(self._buffer) > self._max_buffer:
            self._buffer.clear()
            self.error = StreamOverrun(f"stream of request {self.request_id!r} fell more than {self._max_buffer} "
                                       "outputs behind (client not reading); request aborted")
            self._on_overrun(self)
            # A consumer blocked elsewhere (a write to a client that stopped reading) would never
            # come back to get(): cancel it, the caller turns that into the error.
            if not self._reading and self.consumer is not None and not self.consumer.done():
                self.consumer.cancel()
        self._event.set()

    def _fail(self, error: Exception) -> None:
        if self.error is None and not self.finished:
            self._buffer.clear()
            self.error = error
            self._event.set()


class AsyncEngine:
    """An ``LLMEngine`` on its own thread, driven from asyncio.

    ``start()`` (from the event loop) starts the thread, which loads the model; ``add_request``
    returns a ``RequestStream``; ``abort`` cancels a request (its KV blocks are free before the
    next step); ``load()`` is the latest ``LoadSnapshot``; ``healthy`` is false while loading,
    after the loop died, or while one iteration has run longer than ``stall_timeout_s``.
    """

    def __init__(self, config: EngineConfig, *, max_waiting_requests: int = 1024, max_stream_buffer: int = 1024,
                 stall_timeout_s: float = 60.0, metrics: EngineMetrics | None = None):
        if max_waiting_requests < 0 or max_stream_buffer < 1 or stall_timeout_s <= 0:
            raise ValueError("max_waiting_requests must be >= 0, max_stream_buffer >= 1, stall_timeout_s > 0")
        self.config = config
        self.max_waiting_requests = max_waiting_requests
        self.max_stream_buffer = max_stream_buffer
        self.stall_timeout_s = stall_timeout_s
        self.metrics = metrics
        self.engine: LLMEngine | None = None
        self.tokenizer = None  # the event loop's own instance: the engine thread detokenizes with another
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future | None = None
        self._thread: threading.Thread | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._close_lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._snapshot = LoadSnapshot()
        self._idle = True
        self._heartbeat = time.monotonic()
        self._died: BaseException | None = None
        self._stopping = False

    # ---- lifecycle (event loop) -----------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name="pagoda-engine-loop", daemon=True)
        self._thread.start()

    async def wait_ready(self) -> None:
        """Return once the model is loaded; raise what the load raised."""
        await asyncio.shield(self._ready)

    @property
    def ready(self) -> bool:
        return self._ready is not None and self._ready.done() and self._ready.exception() is None

    @property
    def healthy(self) -> bool:
        if not self.ready or self._closed or self._died is not None:
            return False
        return self._idle or time.monotonic() - self._heartbeat < self.stall_timeout_s

    def status(self) -> str:
        """Why the engine is not healthy, or "serving"."""
        if self._ready is None or not self._ready.done():
            return "model is loading"
        if self._ready.exception() is not None:
            return f"model failed to load: {self._ready.exception()!r}"
        if self._died is not None:
            return f"engine loop died: {self._died!r}"
        if self._closed:
            return "engine stopped"
        if not self.healthy:
            return f"engine loop stalled: no progress for over {self.stall_timeout_s:g} s"
        return "serving"

    async def stop(self) -> None:
        """Stop the loop thread: live requests are aborted, their streams fail as unavailable."""
        if self._thread is None:
            return
        self._submit(self._stop).add_done_callback(_retrieve)
        await asyncio.to_thread(self._thread.join)

    # ---- requests (event loop) ------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          priority: int = 0, arrival_time: float | None = None) -> RequestStream:
        """Validate and queue a request; returns its stream (the calling task is its consumer).

        Raises ValueError (bad prompt or parameters), DuplicateRequestId, QueueFull, EngineUnavailable.
        """
        if not self.healthy:
            raise EngineUnavailable(self.status())
        arrival_time = time.time() if arrival_time is None else arrival_time
        # Tokenize and validate here, off the engine thread; the engine re-checks (cheaply).
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        token_ids = self.engine.truncate_prompt(token_ids, params)
        self.engine.validate_prompt(token_ids)
        self.engine.validate_params(params)
        stream = RequestStream(request_id, self.max_stream_buffer, self._overrun)
        try:
            await self._submit(self._add, stream, {"prompt": text, "prompt_token_ids": token_ids}, params,
                               arrival_time, priority)
        except asyncio.CancelledError:
            # Cancelled (client gone, deadline) while the add was queued: the loop still adds it,
            # so abort it right behind (commands run in order).
            self.abort(request_id, stream)
            raise
        return stream

    def abort(self, request_id: str, stream: RequestStream | None = None) -> asyncio.Future:
        """Abort a live request (only if it is still ``stream``'s, when given); resolves to whether it was live."""
        future = self._submit(self._abort, request_id, stream)
        future.add_done_callback(_retrieve)  # fire-and-forget callers never await it
        return future

    def load(self) -> LoadSnapshot:
        return self._snapshot

    def _overrun(self, stream: RequestStream) -> None:
        self.abort(stream.request_id, stream)
        logger.warning("stream.overrun", request_id=stream.request_id, max_stream_buffer=self.max_stream_buffer)

    def _submit(self, fn: Callable, *args) -> asyncio.Future:
        future = self._loop.create_future()
        with self._close_lock:
            if not self._closed:
                self._commands.put((fn, args, future))
                return future
        future.set_exception(EngineUnavailable(self.status()))
        return future

    # ---- the loop (engine thread) ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = LLMEngine(self.config)
            self.tokenizer = load_tokenizer(self.engine.model_dir)
        except BaseException as e:  # noqa: BLE001 -- reported through wait_ready()
            logger.exception("engine.load_failed")
            self._close(e)
            self._loop.call_soon_threadsafe(_resolve, self._ready, None, e)
            return
        self._publish([])
        self._loop.call_soon_threadsafe(_resolve, self._ready, None, None)
        try:
            self._loop_forever()
        except BaseException as e:  # noqa: BLE001
            logger.exception("engine.loop_died")
            self._died = e
            self._close(EngineUnavailable(f"engine loop died: {e!r}"))
        else:
            self._close(EngineUnavailable("engine stopped"))

    def _loop_forever(self) -> None:
        engine = self.engine
        recent: deque[tuple[float, int]] = deque()
        while not self._stopping:
            callbacks: list[Callable] = []
            if not engine.has_unfinished_requests():
                self._idle = True
                command = self._commands.get()  # nothing to do: block, no spinning
                self._idle = False
                self._heartbeat = time.monotonic()
                self._execute(command, callbacks)
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                self._execute(command, callbacks)
            num_generated = 0
            if engine.has_unfinished_requests() and not self._stopping:
                outputs = engine.step()
                num_generated = self._route(outputs, callbacks)
            now = time.monotonic()
            self._heartbeat = now
            if num_generated:
                recent.append((now, num_generated))
            while recent and now - recent[0][0] > RATE_WINDOW_S:
                recent.popleft()
            self._publish(recent, num_generated)
            if callbacks:
                self._loop.call_soon_threadsafe(_run_all, callbacks)

    def _execute(self, command, callbacks: list[Callable]) -> None:
        fn, args, future = command
        try:
            result, error = fn(*args, callbacks=callbacks), None
        except Exception as e:  # noqa: BLE001 -- the caller gets it
            result, error = None, e
        callbacks.append(lambda: _resolve(future, result, error))

    def _add(self, stream: RequestStream, prompt: dict, params: SamplingParams, arrival_time: float, priority: int,
             *, callbacks) -> None:
        rid = stream.request_id
        if rid in self._streams:
            raise DuplicateRequestId(f"request_id {rid!r} is already in use by a live request")
        sched = self.engine.scheduler
        num_waiting = len(sched.waiting) + len(sched.swapped)
        if num_waiting >= self.max_waiting_requests:
            raise QueueFull(f"waiting queue is full: {num_waiting} requests waiting, "
                            f"max_waiting_requests is {self.max_waiting_requests}")
        request = self.engine.add_request(rid, prompt, params, arrival_time=arrival_time, priority=priority)
        self._streams[rid] = stream
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(request.num_prompt_tokens)

    def _abort(self, request_id: str, stream: RequestStream | None, *, callbacks) -> bool:
        live = self._streams.get(request_id)
        if live is None or (stream is not None and live is not stream):
            return False
        self._route(self.engine.abort_request(request_id), callbacks)
        return True

    def _stop(self, *, callbacks) -> None:
        self._stopping = True

    def _route(self, outputs: list[RequestOutput], callbacks: list[Callable]) -> int:
        """Queue each output for its stream; record per-request metrics. Returns tokens generated."""
        now = time.time()
        metrics = self.metrics
        num_generated = 0
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            n = sum(len(c.delta_token_ids) for c in out.outputs)
            num_generated += n
            if metrics is not None and n:
                if stream.last_output_time is None:
                    metrics.time_to_first_token.observe(now - out.metrics.arrival_time)
                else:
                    metrics.inter_token_latency.observe(now - stream.last_output_time)
            if n:
                stream.last_output_time = now
            if out.finished:
                del self._streams[out.request_id]
                if metrics is not None:
                    metrics.observe_finished(out.outputs[0].finish_reason if out.outputs else "abort", out.metrics)
            callbacks.append(lambda s=stream, o=out: s._push(o))
        return num_generated

    def _publish(self, recent, num_generated: int = 0) -> None:
        sched = self.engine.scheduler
        bm = sched.block_manager
        running = len({s.request.request_id for s in sched.running})
        waiting = len({s.request.request_id for s in sched.waiting}) + len(sched.swapped)
        self._snapshot = LoadSnapshot(bm.num_free_blocks, bm.num_blocks, running, waiting,
                                      sched.num_waiting_tokens(), tuple(recent))
        if self.metrics is not None:
            self.metrics.observe_step(sched, running, waiting, num_generated)

    def _close(self, error: Exception) -> None:
        """Refuse new commands; fail those queued and every live stream."""
        with self._close_lock:
            self._closed = True
        callbacks: list[Callable] = []
        while True:
            try:
                _, _, future = self._commands.get_nowait()
            except queue.Empty:
                break
            callbacks.append(lambda f=future: _resolve(f, None, error))
        if self.engine is not None and self._streams:
            self.engine.abort_request(list(self._streams))
        callbacks += [lambda s=s: s._fail(error) for s in self._streams.values()]
        self._streams.clear()
        if callbacks:
            try:
                self._loop.call_soon_threadsafe(_run_all, callbacks)
            except RuntimeError:  # the event loop is already closed
                pass


def _resolve(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _run_all(callbacks: list[Callable]) -> None:
    for callback in callbacks:
        callback()
