"""The router service: ``pagoda.v1.Router`` over the Redis queue and the engine registry.

A request's walk (DESIGN.md): validate and tokenize; enqueue in the model's queue with this
router as owner; wait until an admission names an engine; stream from that engine, relaying each
delta; release the entry. Admission is done by whichever router has a chance to admit (a request
arrived, a slot was freed, the registry changed, or a 100 ms tick): `RedisRequestQueue.place`
picks the request and the engine in one script and, when the request belongs to another router,
publishes the admission on that router's channel. So requests wait in Redis, in one fleet-wide
order, and no router holds state another needs.

Background tasks, one owner each: the registry watcher (live engines, their limits and
tokenizers; an engine that vanishes has its streams here cut: unstarted ones go back to the
queue, started ones end UNAVAILABLE), the dispatcher (admission rounds), the listener (admission
notices and wake-ups on Redis pub/sub) and maintenance (lease renewal, reaping lapsed routers'
entries, retried releases, Redis-outage handling, a poll that catches a lost notice).
"""
from __future__ import annotations

import asyncio
import random
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pagoda.v1 import common_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc
from router.auth import BearerTokenInterceptor
from router.config import RouterConfig
from router.lifecycle import bounded
from router.metrics import RouterMetrics
from router.queue import DuplicateRequest, EngineRoom, Placed, QueueFull, RedisRequestQueue
from router.registry import EngineRecord, EngineRegistry
from router.security import channel_credentials, connect_redis, redact_url, server_credentials
from router.tokenizer import PromptTokenizer
from router.validation import ModelLimits, ValidRequest, validate

logger = structlog.get_logger("pagoda.router")

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name  # "pagoda.v1.Router"
CODES = grpc.StatusCode
_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
           common_pb2.FINISH_REASON_ABORT: "abort", common_pb2.FINISH_REASON_UNSPECIFIED: ""}
# Engine answers that are the request's fault, relayed as they are and never counted against the engine.
_CLIENT_ERRORS = {CODES.INVALID_ARGUMENT, CODES.OUT_OF_RANGE, CODES.FAILED_PRECONDITION, CODES.NOT_FOUND,
                  CODES.ALREADY_EXISTS}
_REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)
# No client keepalive pings: the engine's server keeps gRPC's default ping policy and answers frequent pings
# with GOAWAY "too_many_pings", which kills every stream on the connection. A dead engine is found by
# its connection failing or its heartbeat lapsing instead.
_ENGINE_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]


class RouterError(Exception):
    """Ends a request with a gRPC status (a Generate stream's status, or a batch item's error)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(eq=False)
class _Forward:
    """One stream to an engine, cut by the registry watcher when the engine vanishes."""

    engine_id: str
    call: grpc.aio.UnaryStreamCall | None = None
    lost: bool = False


@dataclass
class _Progress:
    """What happened to one request so far (for timings, retries and the fault rule)."""

    arrival: float
    admitted_at: float | None = None
    first_token_at: float | None = None
    attempts: int = 0
    sent: bool = False
    unreachable: str | None = None  # the engine whose connection failed on the last attempt
    finish_reasons: list[str] = field(default_factory=list)


class _ModelQueues:
    """The per-model queues over one Redis (one namespace each), created on first use."""

    def __init__(self, redis, config: RouterConfig):
        self._redis, self._config = redis, config
        self._queues: dict[str, RedisRequestQueue] = {}

    def get(self, model: str) -> RedisRequestQueue:
        queue = self._queues.get(model)
        if queue is None:
            c = self._config
            queue = self._queues[model] = RedisRequestQueue(
                self._redis, namespace=f"{c.namespace}:q:{model}", max_queue_size=c.max_queue_size,
                max_queued_tokens=c.max_queued_tokens, max_queue_wait_boost_s=c.max_queue_wait_boost_s,
                max_skips=c.max_skips, priority_step_s=c.priority_step_s, affinity_slack=c.affinity_slack,
                suspect_key=f"{c.namespace}:engine_suspect")
        return queue

    def all(self) -> list[tuple[str, RedisRequestQueue]]:
        return list(self._queues.items())


class RouterServer:
    """One router: the Router service, health, reflection, /metrics and the background tasks."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.router_id = config.router_id
        self.metrics = RouterMetrics()
        self.redis = connect_redis(config.redis_url, password=config.redis_password, ssl_ca_certs=config.redis_ca)
        self.registry = EngineRegistry(self.redis, config.namespace)
        self.queues = _ModelQueues(self.redis, config)
        self.health = HealthServicer()
        self.engines: dict[str, EngineRecord] = {}
        self.models: dict[str, ModelLimits] = {}
        self.tokenizers: dict[str, PromptTokenizer] = {}
        self._fixed_tokenizer = PromptTokenizer.from_dir(config.tokenizer) if config.tokenizer else None
        self._waiters: dict[str, asyncio.Future] = {}
        self._waiting_since: dict[str, float] = {}
        self._waiting_model: dict[str, str] = {}
        self._inflight: dict[str, set[_Forward]] = {}
        self._suspect_until: dict[str, float] = {}
        self._fleet_suspects: set[str] = set()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, engine_pb2_grpc.EngineStub] = {}
        self._pending_releases: set[tuple[str, str, str]] = set()  # (model, request_id, attempt)
        self._tasks: set[asyncio.Task] = set()
        self._background: list[asyncio.Task] = []
        self._wake = asyncio.Event()
        self._redis_down_since: float | None = None
        self._rate_cache: dict[str, tuple[float, float | None]] = {}
        self._num_streams = 0
        self._no_streams = asyncio.Event()
        self._no_streams.set()
        self.draining = False
        self._stopped = asyncio.Event()
        self._server: grpc.aio.Server | None = None
        self._metrics_http = None
        self.port = config.port
        self.metrics_port = config.metrics_port
        if config.engine_tls_ca:
            self._engine_credentials = channel_credentials(config.engine_tls_ca, config.engine_tls_cert,
                                                           config.engine_tls_key)
        else:
            self._engine_credentials = None

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind and serve at once; engines and Redis are picked up as they become reachable."""
        c = self.config
        interceptors = [BearerTokenInterceptor(c.auth_tokens)] if c.auth_tokens else []
        server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", c.max_request_bytes)])
        router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            server)
        address = f"{c.host}:{c.port}"
        if c.tls_cert:
            self.port = server.add_secure_port(address, server_credentials(c.tls_cert, c.tls_key, c.tls_client_ca))
        else:
            self.port = server.add_insecure_port(address)
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        self._server = server
        if self.metrics_port is not None:
            self._metrics_http, _ = self.metrics.serve(self.metrics_port, c.host)
            self.metrics_port = self._metrics_http.server_port
        for loop in (self._watch_registry, self._dispatch, self._listen, self._maintain, self._watch_health):
            self._background.append(asyncio.create_task(loop(), name=f"router-{loop.__name__}"))
        logger.info("router.started", router_id=self.router_id, port=self.port, metrics_port=self.metrics_port,
                    redis=redact_url(c.redis_url), tls=bool(c.tls_cert), auth=bool(c.auth_tokens))

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Refuse new requests (UNAVAILABLE), let streams finish for ``grace_s``, then stop."""
        if self.draining:
            await self._stopped.wait()
            return
        self.draining = True
        grace_s = self.config.shutdown_grace_s if grace_s is None else grace_s
        await self._bounded(self.health.enter_graceful_shutdown(), "health")
        try:
            await asyncio.wait_for(self._no_streams.wait(), grace_s)
        except TimeoutError:
            logger.warning("router.drain_timeout", streams=self._num_streams)
        # Every stage bounded: a stop that waits on a peer (a half-done TLS handshake, a Redis that
        # does not answer) must not keep the router from stopping (seen: gRPC stop > 60 s, rarely).
        if self._server is not None:
            await self._bounded(self._server.stop(grace=1.0), "grpc_server")
        for task in self._background:
            task.cancel()
        await self._bounded(asyncio.gather(*self._background, return_exceptions=True), "background")
        await self._bounded(self._retry_releases(), "releases")
        for channel in self._channels.values():
            await self._bounded(channel.close(), "engine_channel")
        await self._bounded(self.redis.aclose(), "redis")
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        logger.info("router.stopped")
        self._stopped.set()

    @staticmethod
    async def _bounded(awaitable, stage: str, timeout_s: float = 5.0) -> None:
        """One shutdown stage, bounded (``router.lifecycle.bounded``)."""
        await bounded(awaitable, stage, log=logger, prefix="router", timeout_s=timeout_s)

    async def serve(self) -> None:
        """Start, drain and stop on SIGTERM / SIGINT, return when stopped."""
        await self.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.shutdown()))
        await self._stopped.wait()

    def _spawn(self, coro: Awaitable) -> None:
        """Fire and forget, keeping a reference until done."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- Redis health ------------------------------------------------------------------------

    @property
    def redis_up(self) -> bool:
        return self._redis_down_since is None

    def _redis_failed(self, error: BaseException) -> None:
        if self._redis_down_since is None:
            self._redis_down_since = time.monotonic()
            self.metrics.redis_up.set(0)
            logger.warning("redis.unreachable", error=str(error))

    def _redis_ok(self) -> None:
        if self._redis_down_since is not None:
            logger.info("redis.reconnected", outage_s=round(time.monotonic() - self._redis_down_since, 3))
            self._redis_down_since = None
            self._spawn(self._check_waiters_survived())
        self.metrics.redis_up.set(1)

    # ---- one request ---------------------------------------------------------------------------

    def _resolve_model(self, name: str) -> tuple[ModelLimits, PromptTokenizer]:
        if name:
            model = self.models.get(name)
            if model is None:
                raise RouterError(CODES.NOT_FOUND, f"model {name!r} is not served here; served: "
                                  f"{', '.join(sorted(self.models)) or 'none yet'}")
        elif len(self.models) == 1:
            model = next(iter(self.models.values()))
        elif not self.models:
            raise RouterError(CODES.UNAVAILABLE, "no engine has registered yet: nothing can serve the request")
        else:
            raise RouterError(CODES.INVALID_ARGUMENT, "model must be set: this fleet serves "
                              f"{', '.join(sorted(self.models))}")
        tokenizer = self._fixed_tokenizer or self.tokenizers.get(model.model)
        if tokenizer is None:
            raise RouterError(CODES.UNAVAILABLE, f"the tokenizer of model {model.model!r} is not loaded yet")
        return model, tokenizer

    async def run_request(self, request: router_pb2.GenerateRequest, deadline: float | None,
                          emit: Callable[[router_pb2.GenerateResponse], Awaitable], request_id: str | None = None) -> None:
        """Serve one request end to end, passing each response message to ``emit``.

        ``deadline`` is a ``time.monotonic()`` instant or None. Raises RouterError.
        """
        progress = _Progress(arrival=time.monotonic())
        request_id = request.request_id or request_id or uuid.uuid4().hex
        log = logger.bind(request_id=request_id)
        if self.draining:
            raise RouterError(CODES.UNAVAILABLE, "router is shutting down")
        if not self.redis_up:
            raise RouterError(CODES.UNAVAILABLE, "the request queue (Redis) is unreachable; retry later")
        model, tokenizer = self._resolve_model(request.model)
        try:
            if request.WhichOneof("input") == "prompt" and len(request.prompt) > 8192:
                valid = await asyncio.to_thread(validate, request, tokenizer, model, self.config.limits, request_id)
            else:
                valid = validate(request, tokenizer, model, self.config.limits, request_id)
        except ValueError as e:
            raise RouterError(CODES.INVALID_ARGUMENT, str(e)) from None
        queue = self.queues.get(model.model)
        priority = str(valid.priority)
        future = self._new_waiter(request_id, model.model)
        # Names this request's entry in Redis, so that a release (retried late, say) never forgets a
        # newer request that reuses the id.
        attempt = random.randbytes(8).hex()
        enqueued = maybe_enqueued = False
        self.metrics.requests_waiting.labels(priority).inc()
        try:
            try:
                placed = await self._enqueue_and_place(queue, model.model, valid, attempt)
                enqueued = True
            except QueueFull as e:
                raise RouterError(CODES.RESOURCE_EXHAUSTED, str(e)) from None
            except DuplicateRequest:
                raise RouterError(CODES.ALREADY_EXISTS, f"request_id {request_id!r} is already live") from None
            except _REDIS_ERRORS as e:
                # The reply may have been lost after the script ran: released later, when Redis answers.
                maybe_enqueued = True
                self._redis_failed(e)
                raise RouterError(CODES.UNAVAILABLE, "the request queue (Redis) is unreachable; retry later") from None
            log.debug("request.queued", position=placed.position, engine=placed.engine_id,
                      prompt_tokens=len(valid.prompt_token_ids), priority=valid.priority)
            if placed.position is not None:
                await self._check_deadline_can_be_met(queue, model.model, request_id, placed.position, deadline)
            while True:
                engine_id = await self._wait_admission(future, deadline, request_id, queue)
                if progress.admitted_at is None:
                    progress.admitted_at = time.monotonic()
                    self.metrics.requests_waiting.labels(priority).dec()
                    self.metrics.queue_wait.labels(priority).observe(progress.admitted_at - progress.arrival)
                self.metrics.admitted.inc()
                progress.attempts += 1
                done = await self._forward(queue, valid, engine_id, deadline, emit, progress, log)
                if done:
                    return
                if progress.attempts >= self.config.max_attempts:
                    raise RouterError(CODES.UNAVAILABLE, f"no engine could serve the request in "
                                      f"{progress.attempts} attempts; nothing was generated, retry later")
                future = self._new_waiter(request_id, model.model)
                if progress.unreachable is not None:
                    # Its connection failed: tell the fleet before the request goes back, or another
                    # router could place it there again before the engine's heartbeat lapses.
                    await self._mark_suspect(progress.unreachable)
                    progress.unreachable = None
                try:
                    await queue.requeue(request_id)
                except _REDIS_ERRORS as e:
                    self._redis_failed(e)
                    raise RouterError(CODES.UNAVAILABLE, "the request queue (Redis) is unreachable; "
                                      "nothing was generated, retry later") from None
                self._wake.set()
        finally:
            if progress.admitted_at is None:
                self.metrics.requests_waiting.labels(priority).dec()
            self._waiters.pop(request_id, None)
            self._waiting_since.pop(request_id, None)
            self._waiting_model.pop(request_id, None)
            if enqueued:
                # Awaited (one round trip, after the last message) so that the id is free again when the
                # client sees the status: a safe retry with the same id is not refused as ALREADY_EXISTS.
                await asyncio.shield(self._release(model.model, request_id, attempt))
            elif maybe_enqueued:
                self._pending_releases.add((model.model, request_id, attempt))

    def _new_waiter(self, request_id: str, model: str) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = future
        self._waiting_since[request_id] = time.monotonic()
        self._waiting_model[request_id] = model
        return future

    async def _wait_admission(self, future: asyncio.Future, deadline: float | None, request_id: str,
                              queue: RedisRequestQueue) -> str:
        if future.done():  # admitted by the enqueue itself: no timer, no loop iteration
            return future.result()
        # Answer a little before the client's own deadline fires, so that the status carries our message.
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic() - 0.02)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            self.metrics.expired.inc()
            position = None
            try:
                position = await queue.position(request_id)
            except _REDIS_ERRORS:
                pass
            raise RouterError(CODES.DEADLINE_EXCEEDED, "deadline passed while queued"
                              + (f" (still at position {position})" if position is not None else "")) from None

    async def _check_deadline_can_be_met(self, queue: RedisRequestQueue, model: str, request_id: str, position: int,
                                         deadline: float | None) -> None:
        """SLO-aware admission: refuse now a request whose deadline the queue ahead of it would outlast."""
        if deadline is None or position == 0:
            return
        rate = await self._admission_rate(queue, model)
        if rate is None:
            return
        remaining = deadline - time.monotonic()
        estimate = position / rate
        if estimate > remaining:
            try:
                await queue.cancel(request_id)
            except _REDIS_ERRORS:
                pass
            raise RouterError(CODES.RESOURCE_EXHAUSTED,
                              f"deadline cannot be met: {position} requests ahead at the fleet's recent "
                              f"{rate:.2f} admissions/s is an estimated {estimate:.2f} s wait, more than the "
                              f"{remaining:.2f} s left")

    async def _admission_rate(self, queue: RedisRequestQueue, model: str) -> float | None:
        """Admissions per second over the SLO window (cached for 0.5 s); None while there are too few samples."""
        now = time.monotonic()
        cached = self._rate_cache.get(model)
        if cached is not None and now - cached[0] < 0.5:
            return cached[1]
        rate = None
        try:
            n, age = await queue.admission_rate(self.config.slo_window_s)
            if n >= self.config.slo_min_samples and age > 0:
                rate = (n - 1) / age
        except _REDIS_ERRORS:
            pass
        self._rate_cache[model] = (now, rate)
        return rate

    async def _forward(self, queue: RedisRequestQueue, valid: ValidRequest, engine_id: str, deadline: float | None,
                       emit, progress: _Progress, log) -> bool:
        """Stream the request from ``engine_id``. True when it completed; False to put it back in the queue."""
        request_id = valid.request_id
        engine = self.engines.get(engine_id)
        if engine is None:
            log.info("request.engine_gone", engine=engine_id)
            return False
        forward = _Forward(engine_id)
        self._inflight.setdefault(engine_id, set()).add(forward)
        timeout = None if deadline is None else max(0.001, deadline - time.monotonic())
        call = self._engine_stub(engine).Generate(valid.engine_request, timeout=timeout,
                                                  metadata=(("x-request-id", request_id),))
        forward.call = call
        self._num_streams += 1
        self._no_streams.clear()
        self.metrics.requests_running.inc()
        num_messages = 0
        try:
            async for message in call:
                num_messages += 1
                if progress.first_token_at is None:
                    progress.first_token_at = time.monotonic()
                for response in self._responses(message, request_id, progress):
                    await emit(response)
                    progress.sent = True
                if num_messages == 1:
                    self.metrics.ttft.observe(progress.first_token_at - progress.arrival)
                elif num_messages == 2:
                    # The engine has it: its reservation ends (`started`). Not at the first message: that
                    # Redis round trip would compete with the first token's way to the client (0.3 ms of
                    # TTFT p50 on a 2-core host); one engine step later the engine's own load reports
                    # lag behind anyway. A one-message stream's reservation ends with its release.
                    self._spawn(self._started(queue, request_id))
            self.metrics.e2e.observe(time.monotonic() - progress.arrival)
            for reason in progress.finish_reasons:
                self.metrics.finished.labels(reason).inc()
            log.info("request.finished", engine=engine_id, finish_reason=progress.finish_reasons,
                     ttft_s=round(progress.first_token_at - progress.arrival, 4) if progress.first_token_at else None,
                     queue_s=round(progress.admitted_at - progress.arrival, 4), attempts=progress.attempts)
            return True
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not forward.lost or task.cancelling():
                raise
            return self._engine_fault(engine_id, progress, "engine left the registry (heartbeat lapsed)", log)
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code == CODES.DEADLINE_EXCEEDED:
                raise RouterError(CODES.DEADLINE_EXCEEDED, "deadline passed while generating") from None
            if code in _CLIENT_ERRORS:
                # The request's fault, not the engine's: relayed, and the engine stays in good standing.
                raise RouterError(code, e.details()) from None
            if code == CODES.RESOURCE_EXHAUSTED:
                if progress.sent:
                    raise RouterError(code, e.details()) from None
                # The engine's own waiting queue is full (load reports lag): not a fault, try again shortly.
                self._suspect_until[engine_id] = time.monotonic() + 0.2
                self.metrics.readmitted.labels("engine_full").inc()
                log.info("request.engine_full", engine=engine_id)
                return False
            if forward.lost and code == CODES.CANCELLED:
                return self._engine_fault(engine_id, progress, "engine left the registry (heartbeat lapsed)", log)
            if code == CODES.UNAVAILABLE:
                progress.unreachable = engine_id
            return self._engine_fault(engine_id, progress, f"{code.name}: {e.details()}", log)
        finally:
            self._num_streams -= 1
            if self._num_streams == 0:
                self._no_streams.set()
            self.metrics.requests_running.dec()
            self._inflight.get(engine_id, set()).discard(forward)
            if not call.done():
                call.cancel()

    def _engine_fault(self, engine_id: str, progress: _Progress, reason: str, log) -> bool:
        """A transport or server fault of the engine: back off from it; retry only if nothing was sent."""
        self.metrics.engine_faults.labels(engine_id).inc()
        self._suspect_until[engine_id] = time.monotonic() + self.config.engine_fault_backoff_s
        if progress.sent or progress.first_token_at is not None:
            log.warning("request.engine_failed_mid_stream", engine=engine_id, reason=reason)
            raise RouterError(CODES.UNAVAILABLE, f"engine {engine_id} failed after output had been sent "
                              f"({reason}); the request was not retried")
        log.info("request.readmitted", engine=engine_id, reason=reason)
        self.metrics.readmitted.labels("engine_fault").inc()
        return False

    def _responses(self, message, request_id: str, progress: _Progress) -> list[router_pb2.GenerateResponse]:
        out = []
        for chunk in message.chunks:
            response = router_pb2.GenerateResponse(
                request_id=request_id, index=chunk.index, text=chunk.text, token_ids=chunk.token_ids,
                logprobs=chunk.logprobs, finish_reason=_FINISH[chunk.finish_reason])
            which = chunk.WhichOneof("stop_reason")
            if which == "stop_str":
                response.stop_str = chunk.stop_str
            elif which == "stop_token_id":
                response.stop_token_id = chunk.stop_token_id
            if response.finish_reason:
                progress.finish_reasons.append(response.finish_reason)
            out.append(response)
        if message.prompt_logprobs:
            if not out:
                out.append(router_pb2.GenerateResponse(request_id=request_id))
            out[0].prompt_logprobs.extend(message.prompt_logprobs)
        if message.finished:
            if not out:
                out.append(router_pb2.GenerateResponse(request_id=request_id))
            last = out[-1]
            last.finished = True
            last.usage.CopyFrom(message.usage)
            now = time.monotonic()
            last.timings.queue_time_s = (progress.admitted_at - progress.arrival) + message.timings.queue_time_s
            last.timings.ttft_s = (progress.first_token_at or now) - progress.arrival
            last.timings.e2e_s = now - progress.arrival
        return out

    def _engine_stub(self, engine: EngineRecord) -> engine_pb2_grpc.EngineStub:
        """One channel and one stub per engine address, made on first use (a stub builds a callable per
        method: not per request)."""
        stub = self._stubs.get(engine.address)
        if stub is None:
            if self._engine_credentials is not None:
                channel = grpc.aio.secure_channel(engine.address, self._engine_credentials, _ENGINE_CHANNEL_OPTIONS)
            else:
                channel = grpc.aio.insecure_channel(engine.address, _ENGINE_CHANNEL_OPTIONS)
            self._channels[engine.address] = channel
            stub = self._stubs[engine.address] = engine_pb2_grpc.EngineStub(channel)
        return stub

    async def _mark_suspect(self, engine_id: str) -> None:
        try:
            await self.registry.mark_suspect(engine_id, self.config.engine_fault_backoff_s)
        except _REDIS_ERRORS:
            pass

    async def _started(self, queue: RedisRequestQueue, request_id: str) -> None:
        try:
            await queue.started(request_id)
        except _REDIS_ERRORS:
            pass  # the reservation goes with the release

    async def _release(self, model: str, request_id: str, attempt: str = "") -> None:
        try:
            await self.queues.get(model).release(request_id, attempt)
        except _REDIS_ERRORS as e:
            self._redis_failed(e)
            self._pending_releases.add((model, request_id, attempt))

    async def _retry_releases(self) -> None:
        for entry in list(self._pending_releases):
            model, request_id, attempt = entry
            try:
                await self.queues.get(model).release(request_id, attempt)
                self._pending_releases.discard(entry)
            except _REDIS_ERRORS:
                return

    # ---- admissions --------------------------------------------------------------------------

    def _on_admitted(self, request_id: str, engine_id: str, model: str) -> None:
        future = self._waiters.get(request_id)
        if future is not None and not future.done():
            future.set_result(engine_id)
        elif future is None:
            # Not waited for here (its client left before the entry was gone): drop it.
            self._spawn(self._release(model, request_id))

    async def _enqueue_and_place(self, queue: RedisRequestQueue, model: str, valid: ValidRequest,
                                 attempt: str) -> Placed:
        """Enqueue and run one admission in the same script, in the request's own task: when an engine
        has room (moderate load) the request is on its way after one Redis round trip, without a
        second one for the admission nor waiting for the dispatcher task to be scheduled."""
        placed = await queue.enqueue_and_place(
            valid.request_id, b"", self._rooms(model), priority=valid.priority,
            num_prompt_tokens=len(valid.prompt_token_ids), attempt=attempt, caller=self.router_id,
            owner=self.router_id, prefix=valid.prefix_key, lease_ttl_s=self.config.lease_ttl_s)
        self._redis_ok()
        admitted = placed.admitted
        if placed.engine_id is not None:
            # Ours already, also when this was a retried run of the script (its first reply lost).
            self._on_admitted(valid.request_id, placed.engine_id, model)
        if admitted is not None and admitted.request_id != valid.request_id and admitted.owner == self.router_id:
            self._on_admitted(admitted.request_id, admitted.engine_id, model)  # another of ours, ahead of it
        if admitted is not None and placed.depth > 0:
            # More may fit: the dispatcher goes on. (Nothing admitted: a round now would find the same.)
            self._wake.set()
        return placed

    def _rooms(self, model: str) -> list[EngineRoom]:
        now = time.monotonic()
        extra = self.config.engine_max_waiting
        return [EngineRoom(e.engine_id, e.free_tokens, e.max_num_seqs + extra) for e in self.engines.values()
                if e.model == model and e.accepting and self._suspect_until.get(e.engine_id, 0.0) <= now
                and e.engine_id not in self._fleet_suspects]

    async def _dispatch(self) -> None:
        """Admission rounds: whenever woken (or every 100 ms), admit while any engine has room."""
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), 0.1)
            except TimeoutError:
                pass
            self._wake.clear()
            if not self.redis_up and random.random() > 0.1:
                continue  # while Redis is away, probe one tick in ten
            for model in list(self.models):
                queue = self.queues.get(model)
                rooms = self._rooms(model)
                try:
                    while rooms:
                        admitted = await queue.place(rooms, caller=self.router_id)
                        if admitted is None:
                            break
                        if admitted.owner == self.router_id:
                            self._on_admitted(admitted.request_id, admitted.engine_id, model)
                    self._redis_ok()
                except _REDIS_ERRORS as e:
                    self._redis_failed(e)
                except RedisError as e:
                    logger.error("dispatch.failed", error=str(e))

    async def _listen(self) -> None:
        """Admission notices from other routers and wake-ups, on Redis pub/sub (resubscribes after an outage)."""
        ns = self.config.namespace
        admitted_pattern = f"{ns}:q:*:admitted:{self.router_id}"
        wake_pattern = f"{ns}:q:*:wake"
        prefix = f"{ns}:q:".encode()
        backoff = 0.05
        while True:
            pubsub = self.redis.pubsub()
            try:
                await pubsub.psubscribe(admitted_pattern, wake_pattern)
                backoff = 0.05
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is None or message["type"] != "pmessage":
                        continue
                    channel = message["channel"]
                    if channel.endswith(b":wake"):
                        self._wake.set()
                        continue
                    model = channel[len(prefix):].rsplit(b":admitted:", 1)[0].decode()
                    request_id, engine_id = message["data"].decode().rsplit(" ", 1)
                    self._on_admitted(request_id, engine_id, model)
            except asyncio.CancelledError:
                raise
            except (*_REDIS_ERRORS, RedisError) as e:
                self._redis_failed(e)
                await asyncio.sleep(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, 2.0)
            finally:
                try:
                    await pubsub.aclose()
                except Exception:  # noqa: BLE001 -- the connection is already broken
                    pass

    # ---- registry ----------------------------------------------------------------------------

    async def _watch_registry(self) -> None:
        backoff = self.config.registry_refresh_s
        while True:
            try:
                live, self._fleet_suspects = await self.registry.live()
                self._redis_ok()
                await self._update_engines(live)
                backoff = self.config.registry_refresh_s
            except _REDIS_ERRORS as e:
                self._redis_failed(e)
                backoff = min(backoff * 2, 2.0)
            except RedisError as e:
                logger.error("registry.read_failed", error=str(e))
            await asyncio.sleep(backoff)

    async def _update_engines(self, live: dict[str, EngineRecord]) -> None:
        previous = self.engines
        for engine_id in previous.keys() - live.keys():
            logger.warning("engine.left", engine=engine_id, address=previous[engine_id].address)
            self.metrics.forget_engine(engine_id)
            for forward in list(self._inflight.get(engine_id, ())):
                forward.lost = True
                if forward.call is not None:
                    forward.call.cancel()
        for engine_id in live.keys() - previous.keys():
            r = live[engine_id]
            logger.info("engine.joined", engine=engine_id, address=r.address, model=r.model)
            if r.model not in self.tokenizers and self._fixed_tokenizer is None:
                files = await self.registry.fetch_tokenizer(r.model)
                if files is not None:
                    self.tokenizers[r.model] = await asyncio.to_thread(PromptTokenizer, files)
        models: dict[str, ModelLimits] = {}
        for r in live.values():
            m = models.get(r.model)
            models[r.model] = ModelLimits(r.model, r.max_model_len, r.vocab_size, r.max_logprobs, r.block_size) if m is None \
                else ModelLimits(r.model, min(m.max_model_len, r.max_model_len), min(m.vocab_size, r.vocab_size),
                                 min(m.max_logprobs, r.max_logprobs), min(m.block_size, r.block_size))
        # A model keeps its limits while its engines restart: requests queue instead of failing.
        self.models = {**self.models, **models}
        self.engines = live
        self.metrics.engines_live.set(len(live))
        for r in live.values():
            self.metrics.engine_free_blocks.labels(r.engine_id).set(r.num_free_blocks)
            self.metrics.engine_running.labels(r.engine_id).set(r.num_running_requests)
            self.metrics.engine_waiting.labels(r.engine_id).set(r.num_waiting_requests)
            self.metrics.engine_tokens_per_s.labels(r.engine_id).set(r.output_tokens_per_s)
        if live.keys() != previous.keys() or any(
                r.accepting != previous[k].accepting for k, r in live.items() if k in previous):
            self._wake.set()

    # ---- maintenance -------------------------------------------------------------------------

    async def _maintain(self) -> None:
        c = self.config
        while True:
            try:
                queues = self.queues.all() or [(m, self.queues.get(m)) for m in self.models]
                for model, queue in queues:
                    await queue.renew_lease(self.router_id, c.lease_ttl_s)
                    reaped = await queue.reap()
                    if reaped:
                        logger.info("queue.reaped", model=model, requests=len(reaped))
                    self.metrics.queue_depth.set(await queue.depth())
                    self.metrics.queued_tokens.set(await queue.queued_tokens())
                    active = await queue.active_counts()
                    for engine_id in self.engines:
                        self.metrics.engine_admitted.labels(engine_id).set(active.get(engine_id, 0))
                self._redis_ok()
                await self._retry_releases()
                await self._poll_waiters()
            except _REDIS_ERRORS as e:
                self._redis_failed(e)
            except RedisError as e:
                logger.error("maintenance.failed", error=str(e))
            if self._redis_down_since is not None and time.monotonic() - self._redis_down_since > c.redis_outage_grace_s:
                self._fail_waiters("the request queue (Redis) has been unreachable for over "
                                   f"{c.redis_outage_grace_s:g} s; nothing was generated, retry later")
            await asyncio.sleep(c.maintenance_interval_s if self.redis_up else min(0.25, c.maintenance_interval_s))

    async def _poll_waiters(self) -> None:
        """Catch an admission whose pub/sub notice was lost (for requests waiting over a second)."""
        now = time.monotonic()
        by_model: dict[str, list[str]] = {}
        for request_id, since in list(self._waiting_since.items()):
            if now - since > 1.0 and not self._waiters[request_id].done():
                by_model.setdefault(self._waiting_model[request_id], []).append(request_id)
        for model, ids in by_model.items():
            for request_id, engine_id in zip(ids, await self.queues.get(model).engines_of(ids)):
                if engine_id is not None:
                    self._on_admitted(request_id, engine_id, model)

    def _fail_waiters(self, message: str) -> None:
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(RouterError(CODES.UNAVAILABLE, message))

    async def _check_waiters_survived(self) -> None:
        """After an outage: requests whose entries Redis lost (a restart without persistence) fail UNAVAILABLE."""
        for request_id, model in list(self._waiting_model.items()):
            future = self._waiters.get(request_id)
            if future is None or future.done():
                continue
            try:
                queue = self.queues.get(model)
                engine = (await queue.engines_of([request_id]))[0]
                if engine is not None:
                    self._on_admitted(request_id, engine, model)
                elif await queue.position(request_id) is None and not future.done():
                    future.set_exception(RouterError(CODES.UNAVAILABLE, "the queue lost this request (Redis "
                                                     "restarted); nothing was generated, retry"))
            except _REDIS_ERRORS:
                return

    async def _watch_health(self) -> None:
        serving = None
        while True:
            now_serving = (not self.draining and self.redis_up
                           and any(e.accepting for e in self.engines.values()))
            if now_serving != serving:
                serving = now_serving
                status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
                for service in ("", SERVICE_NAME):
                    await self.health.set(service, status)
                logger.info("router.health", serving=serving, redis_up=self.redis_up, engines=len(self.engines))
            await asyncio.sleep(0.25)


class RouterServicer(router_pb2_grpc.RouterServicer):
    """``pagoda.v1.Router``: each handler runs requests through ``RouterServer.run_request``."""

    def __init__(self, server: RouterServer):
        self.server = server

    @staticmethod
    def _deadline(context) -> float | None:
        remaining = context.time_remaining()
        return None if remaining is None else time.monotonic() + remaining

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            await self.server.run_request(request, self._deadline(context), context.write)
        except RouterError as e:
            self.server.metrics.rejected.labels(e.code.name).inc()
            logger.info("request.error", request_id=request.request_id or None, code=e.code.name, error=e.message)
            await context.abort(e.code, e.message)

    async def GenerateBatch(self, request: router_pb2.GenerateBatchRequest, context: grpc.aio.ServicerContext):
        limit = self.server.config.max_batch_size
        if len(request.requests) > limit:
            await context.abort(CODES.INVALID_ARGUMENT, f"requests has {len(request.requests)} items; "
                                f"the limit is {limit} (max_batch_size)")
        deadline = self._deadline(context)
        batch_id = uuid.uuid4().hex[:16]
        tasks = [asyncio.create_task(self._item(i, item, deadline, f"{batch_id}-{i}"))
                 for i, item in enumerate(request.requests)]
        try:
            for next_done in asyncio.as_completed(tasks):
                await context.write(await next_done)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _item(self, index: int, request: router_pb2.GenerateRequest, deadline: float | None,
                    fallback_id: str) -> router_pb2.GenerateBatchResponse:
        result = router_pb2.GenerateBatchResponse(index=index, request_id=request.request_id or fallback_id)
        completions: dict[int, router_pb2.Completion] = {}

        async def collect(response: router_pb2.GenerateResponse) -> None:
            c = completions.get(response.index)
            if c is None:
                c = completions[response.index] = router_pb2.Completion(index=response.index)
            c.text += response.text
            c.token_ids.extend(response.token_ids)
            c.logprobs.extend(response.logprobs)
            result.prompt_logprobs.extend(response.prompt_logprobs)
            if response.finish_reason:
                c.finish_reason = response.finish_reason
            which = response.WhichOneof("stop_reason")
            if which:
                setattr(c, which, getattr(response, which))
            if response.finished:
                result.usage.CopyFrom(response.usage)
                result.timings.CopyFrom(response.timings)

        try:
            await self.server.run_request(request, deadline, collect, request_id=fallback_id)
        except RouterError as e:
            self.server.metrics.rejected.labels(e.code.name).inc()
            result.error_code, result.error_message = e.code.value[0], e.message
            return result
        result.completions.extend(completions[i] for i in sorted(completions))
        return result

    async def ListModels(self, request, context) -> router_pb2.ListModelsResponse:
        server = self.server
        cards = []
        for name, m in sorted(server.models.items()):
            n = sum(1 for e in server.engines.values() if e.model == name)
            cards.append(router_pb2.ModelCard(id=name, max_model_len=m.max_model_len, vocab_size=m.vocab_size,
                                              num_engines=n))
        return router_pb2.ListModelsResponse(models=cards)
