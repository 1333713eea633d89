"""The engine gRPC server: ``pagoda.v1.Engine`` over an ``AsyncEngine``, with the standard health
and reflection services and a Prometheus endpoint.

Lifecycle: ``start()`` binds the port at once with health NOT_SERVING and loads the model in the
engine thread; health turns SERVING when it is loaded, and back to NOT_SERVING if the engine loop
stalls or dies. ``shutdown()`` refuses new streams with UNAVAILABLE, lets running ones finish for
a grace period, then cancels the rest (which aborts their requests) and stops the engine.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
import uuid

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from engine_service.async_engine import (AsyncEngine, DuplicateRequestId, EngineUnavailable, QueueFull,
                                         StreamOverrun)
from engine_service.config import EngineConfig
from engine_service.metrics import EngineMetrics
from engine_service.model_loader import BUNDLED_GGUF_NAME, BUNDLED_MODEL
from engine_service.outputs import RequestOutput
from engine_service.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from router.lifecycle import bounded

logger = structlog.get_logger("pagoda.engine_service")

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name  # "pagoda.v1.Engine"

_FINISH_REASONS = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
                   "abort": common_pb2.FINISH_REASON_ABORT}
_ERROR_CODES = ((ValueError, grpc.StatusCode.INVALID_ARGUMENT), (DuplicateRequestId, grpc.StatusCode.ALREADY_EXISTS),
                (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED), (StreamOverrun, grpc.StatusCode.RESOURCE_EXHAUSTED),
                (EngineUnavailable, grpc.StatusCode.UNAVAILABLE))
# Proto fields that are `optional` because their default is not zero; unset means SamplingParams' default.
_OPTIONAL_PARAMS = ("n", "temperature", "top_p", "repetition_penalty", "seed", "logprobs", "skip_special_tokens",
                    "prompt_logprobs", "truncate_prompt_tokens")


def structured_outputs_from_proto(p: common_pb2.StructuredOutputs) -> StructuredOutputsParams | None:
    which = p.WhichOneof("kind")
    if which is None:
        return None
    value = list(p.choice.choices) if which == "choice" else getattr(p, which)
    return StructuredOutputsParams(**{which: value}, disable_any_whitespace=p.disable_any_whitespace)


def sampling_params_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """The proto's SamplingParams as the engine's; ValueError names a bad field. Unset max_tokens
    means up to max_model_len, as in vLLM's server."""
    kwargs = {name: getattr(p, name) for name in _OPTIONAL_PARAMS if p.HasField(name)}
    if p.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_outputs_from_proto(p.structured_outputs)
    if p.logit_bias:
        kwargs["logit_bias"] = dict(p.logit_bias)
    if p.allowed_token_ids:
        kwargs["allowed_token_ids"] = list(p.allowed_token_ids)
    if p.bad_words:
        kwargs["bad_words"] = list(p.bad_words)
    return SamplingParams(
        top_k=p.top_k, min_p=p.min_p, presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), include_stop_str_in_output=p.include_stop_str_in_output,
        ignore_eos=p.ignore_eos, max_tokens=p.max_tokens if p.HasField("max_tokens") else None,
        min_tokens=p.min_tokens, **kwargs)


def default_model_name(model: str | None) -> str:
    if model is None or model == BUNDLED_MODEL:
        return BUNDLED_GGUF_NAME.split(".")[0]
    name = os.path.basename(os.path.normpath(model))
    return name[:-5] if name.endswith(".gguf") else name


def _error_code(error: Exception) -> grpc.StatusCode:
    return next(code for kind, code in _ERROR_CODES if isinstance(error, kind))


class _ResponseBuilder:
    """Turns the outputs buffered since the last message into one ``EngineGenerateResponse``."""

    def __init__(self, request_id: str, params: SamplingParams):
        self.request_id = request_id
        self.logprobs = params.logprobs or 0  # top alternatives a position carries
        self.prompt_logprobs = params.prompt_logprobs  # None once sent (with the first message)
        self.done: set[int] = set()  # completions whose final chunk was sent

    def build(self, outputs: list[RequestOutput]) -> engine_pb2.EngineGenerateResponse:
        chunks: dict[int, common_pb2.TokenChunk] = {}
        for out in outputs:
            for c in out.outputs:
                if c.index in self.done or not (c.delta_token_ids or c.delta_text or c.finish_reason):
                    continue
                chunk = chunks.get(c.index)
                if chunk is None:
                    chunk = chunks[c.index] = common_pb2.TokenChunk(index=c.index)
                chunk.text += c.delta_text
                chunk.token_ids.extend(c.delta_token_ids)
                if c.delta_logprobs:
                    chunk.logprobs.extend(_logprobs(c.delta_token_ids, c.delta_logprobs, self.logprobs))
                if c.finish_reason:
                    self.done.add(c.index)
                    chunk.finish_reason = _FINISH_REASONS[c.finish_reason]
                    if isinstance(c.stop_reason, str):
                        chunk.stop_str = c.stop_reason
                    elif c.stop_reason is not None:
                        chunk.stop_token_id = c.stop_reason
        response = engine_pb2.EngineGenerateResponse(request_id=self.request_id,
                                               chunks=[chunks[i] for i in sorted(chunks)])
        last = outputs[-1]
        if self.prompt_logprobs is not None and last.prompt_logprobs is not None:
            response.prompt_logprobs.extend(
                _logprobs(last.prompt_token_ids[1:], last.prompt_logprobs[1:], self.prompt_logprobs))
            self.prompt_logprobs = None
        if last.finished:
            response.finished = True
            response.usage.prompt_tokens = len(last.prompt_token_ids)
            response.usage.completion_tokens = sum(len(c.token_ids) for c in last.outputs)
            response.usage.cached_prompt_tokens = last.num_cached_tokens
            m = last.metrics
            if m is not None:
                since = (lambda t: max(0.0, t - m.arrival_time) if t is not None else 0.0)
                response.timings.queue_time_s = since(m.first_scheduled_time)
                response.timings.ttft_s = since(m.first_token_time)
                response.timings.e2e_s = since(m.finished_time)
        return response


def _logprobs(token_ids: list[int], positions: list[dict], k: int) -> list[common_pb2.PositionLogprobs]:
    """Each position's token and its top ``k``: an entry's first ``k`` items (the engine puts the top
    ones first, by rank, and the token's own after them when it is not among them)."""
    result = []
    for token_id, entry in zip(token_ids, positions):
        sampled = entry[token_id]
        top = itertools.islice(entry.items(), k)
        result.append(common_pb2.PositionLogprobs(
            sampled=common_pb2.TokenLogprob(token_id=token_id, logprob=sampled.logprob, rank=sampled.rank,
                                            token=sampled.decoded_token),
            top=[common_pb2.TokenLogprob(token_id=tid, logprob=lp.logprob, rank=lp.rank, token=lp.decoded_token)
                 for tid, lp in top]))
    return result


class EngineServicer(engine_pb2_grpc.EngineServicer):
    """``pagoda.v1.Engine``: every handler only talks to the ``AsyncEngine``."""

    def __init__(self, server: "EngineServer"):
        self.server = server
        self.engine = server.engine

    async def Generate(self, request: engine_pb2.EngineGenerateRequest, context: grpc.aio.ServicerContext):
        arrival_time = time.time()
        request_id = request.request_id or uuid.uuid4().hex
        log = logger.bind(request_id=request_id)
        try:
            refusal = self.server.refusal()
            if refusal is not None:
                raise EngineUnavailable(refusal)
            which = request.WhichOneof("prompt")
            if which is None:
                raise ValueError("prompt is missing: set text or prompt_token_ids")
            prompt = request.text if which == "text" else list(request.prompt_token_ids.ids)
            params = sampling_params_from_proto(request.sampling_params)
            stream = await self.engine.add_request(request_id, prompt, params, request.priority, arrival_time)
        except (ValueError, DuplicateRequestId, QueueFull, EngineUnavailable) as e:
            await self._abort_rpc(context, log, e)
        builder = _ResponseBuilder(request_id, params)
        self.server.stream_opened()
        try:
            while True:
                outputs = await stream.get()
                if not outputs:
                    break
                response = builder.build(outputs)
                await context.write(response)
                if response.finished:
                    _log_finished(log, outputs[-1])
                    break
        except asyncio.CancelledError:
            # Our own cancel when the client stopped reading (see RequestStream); else the
            # client cancelled, disconnected or hit its deadline: the finally aborts the request.
            if isinstance(stream.error, StreamOverrun):
                asyncio.current_task().uncancel()
                await self._abort_rpc(context, log, stream.error)
            raise
        except (StreamOverrun, EngineUnavailable) as e:
            await self._abort_rpc(context, log, e)
        finally:
            if not stream.finished and stream.error is None:
                self.engine.abort(request_id, stream)
                log.info("request.cancelled", reason="client cancelled, disconnected or deadline exceeded")
            self.server.stream_closed()

    async def _abort_rpc(self, context, log, error: Exception) -> None:
        """End the RPC with the status that ``error`` maps to (logged and counted)."""
        code = _error_code(error)
        log.info("request.error", code=code.name, error=str(error))
        if self.server.metrics is not None:
            self.server.metrics.observe_rejected(code.name)
        await context.abort(code, str(error))

    async def Abort(self, request: engine_pb2.AbortRequest, context) -> engine_pb2.AbortResponse:
        try:
            found = await self.engine.abort(request.request_id)
        except EngineUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        if found:
            logger.info("request.aborted", request_id=request.request_id)
        return engine_pb2.AbortResponse(found=found)

    async def GetLoad(self, request, context) -> common_pb2.EngineLoad:
        load = self.engine.load()
        config = self.engine.config
        return common_pb2.EngineLoad(
            num_free_blocks=load.num_free_blocks, num_total_blocks=load.num_total_blocks,
            block_size=config.block_size, num_running_requests=load.num_running_requests,
            num_waiting_requests=load.num_waiting_requests, num_waiting_prompt_tokens=load.num_waiting_prompt_tokens,
            output_tokens_per_s=load.output_tokens_per_s(), max_num_seqs=config.max_num_seqs,
            max_waiting_requests=self.engine.max_waiting_requests, accepting=self.server.refusal() is None)

    async def ModelInfo(self, request, context) -> engine_pb2.ModelInfoResponse:
        if not self.engine.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.engine.status())
        engine = self.engine.engine
        return engine_pb2.ModelInfoResponse(
            model_id=self.server.model_name, model=engine.config.model or BUNDLED_MODEL, tokenizer=engine.model_dir,
            max_model_len=engine.config.max_model_len, vocab_size=engine.vocab_size,
            eos_token_ids=sorted(engine.eos_token_ids), block_size=engine.config.block_size,
            dtype=engine.config.dtype)


def _log_finished(log, out: RequestOutput) -> None:
    m = out.metrics
    log.info("request.finished", finish_reason=[c.finish_reason for c in out.outputs],
             prompt_tokens=len(out.prompt_token_ids), completion_tokens=sum(len(c.token_ids) for c in out.outputs),
             cached_prompt_tokens=out.num_cached_tokens,
             ttft_s=round(m.first_token_time - m.arrival_time, 4) if m and m.first_token_time else None,
             e2e_s=round(m.finished_time - m.arrival_time, 4) if m and m.finished_time else None)


class EngineServer:
    """One engine behind gRPC: the Engine service, health, reflection and /metrics.

    ``port=0`` / ``metrics_port=0`` pick free ports (read ``.port`` / ``.metrics_port`` after
    ``start()``); ``metrics_port=None`` serves no metrics.
    """

    def __init__(self, config: EngineConfig, *, host: str = "0.0.0.0", port: int = 50051,
                 metrics_port: int | None = None, served_model_name: str | None = None,
                 max_waiting_requests: int = 1024, max_stream_buffer: int = 1024, stall_timeout_s: float = 60.0,
                 shutdown_grace_s: float = 30.0, health_check_interval_s: float = 0.5,
                 server_credentials: grpc.ServerCredentials | None = None):
        self.host, self.port, self.metrics_port = host, port, metrics_port
        self.server_credentials = server_credentials  # TLS (mutual with a client CA) instead of plaintext
        self.model_name = served_model_name or default_model_name(config.model)
        self.metrics = EngineMetrics(self.model_name)
        self.engine = AsyncEngine(config, max_waiting_requests=max_waiting_requests,
                                  max_stream_buffer=max_stream_buffer, stall_timeout_s=stall_timeout_s,
                                  metrics=self.metrics)
        self.shutdown_grace_s = shutdown_grace_s
        self.health_check_interval_s = health_check_interval_s
        self.health = HealthServicer()
        self.draining = False
        self._server: grpc.aio.Server | None = None
        self._metrics_http = None
        self._watchdog: asyncio.Task | None = None
        self._num_streams = 0
        self._no_streams = asyncio.Event()
        self._stopped = asyncio.Event()
        self._shutdown_started = False

    async def start(self) -> None:
        """Bind and serve at once (health NOT_SERVING); the model loads in the engine thread."""
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        engine_pb2_grpc.add_EngineServicer_to_server(EngineServicer(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            server)
        if self.server_credentials is not None:
            self.port = server.add_secure_port(f"{self.host}:{self.port}", self.server_credentials)
        else:
            self.port = server.add_insecure_port(f"{self.host}:{self.port}")
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        self._server = server
        if self.metrics_port is not None:
            self._metrics_http, _ = self.metrics.serve(self.metrics_port, self.host)
            self.metrics_port = self._metrics_http.server_port
        self._no_streams.set()
        self.engine.start()
        self._watchdog = asyncio.create_task(self._watch_health())
        logger.info("server.started", port=self.port, metrics_port=self.metrics_port, model=self.model_name)

    async def wait_ready(self) -> None:
        """Return once the model is loaded (raise if it failed to load)."""
        await self.engine.wait_ready()

    def refusal(self) -> str | None:
        """Why a new stream would be refused now, or None."""
        if self.draining:
            return "server is shutting down"
        return None if self.engine.healthy else self.engine.status()

    def stream_opened(self) -> None:
        self._num_streams += 1
        self._no_streams.clear()

    def stream_closed(self) -> None:
        self._num_streams -= 1
        if self._num_streams == 0:
            self._no_streams.set()

    async def _watch_health(self) -> None:
        serving = None
        while True:
            now_serving = self.refusal() is None
            if now_serving != serving:
                serving = now_serving
                status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
                for service in ("", SERVICE_NAME):
                    await self.health.set(service, status)
                logger.info("server.health", serving=serving, status=self.engine.status())
            await asyncio.sleep(self.health_check_interval_s)

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Refuse new streams (UNAVAILABLE), drain running ones for ``grace_s``, then stop everything."""
        if self._shutdown_started:
            await self._stopped.wait()
            return
        self._shutdown_started = True
        grace_s = self.shutdown_grace_s if grace_s is None else grace_s
        self.draining = True
        await bounded(self.health.enter_graceful_shutdown(), "health", log=logger)
        logger.info("server.draining", streams=self._num_streams, grace_s=grace_s)
        try:
            await asyncio.wait_for(self._no_streams.wait(), grace_s)
        except TimeoutError:
            logger.warning("server.drain_timeout", streams_cancelled=self._num_streams)
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._server is not None:
            # Cancels what is left (their handlers abort their requests); bounded, as in the router:
            # a stop waiting on a half-done peer must not hold the process.
            await bounded(self._server.stop(grace=1.0), "grpc_server", log=logger)
        await self.engine.stop()  # not bounded: it joins the engine thread, which exits after its step
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        logger.info("server.stopped")
        self._stopped.set()

    async def serve(self) -> None:
        """Start, stop on SIGTERM / SIGINT (draining for ``shutdown_grace_s``), return when stopped."""
        await self.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.shutdown()))
        try:
            await self.wait_ready()
        except Exception:
            await self.shutdown(0)
            raise
        await self._stopped.wait()
