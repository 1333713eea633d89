"""Where a batch job's requests run: in this process (``LocalBackend``, the step loop of an
``LLMEngine`` fed with many rows at once) or through gRPC (``RemoteBackend`` over a
``GenerateClient``: the Pagoda router's ``pagoda.v1.Router`` or one engine's ``pagoda.v1.Engine``).

A backend takes an iterator of ``BatchRequest`` and calls ``emit(request, BatchResult | RowError)``
once per request as it completes, in completion order, from the caller's thread. A row-level
failure (bad prompt, invalid schema) is a ``RowError``; a failure of the backend itself (the
engine raised, the cluster stayed unavailable) raises out of ``run`` and leaves the rows in flight
unwritten, so a re-run does them.
"""
from __future__ import annotations

import abc
import asyncio
import itertools
import json
import logging
import os
import uuid
from collections.abc import Callable, Iterator

from engine_service.batch_rows import (BatchRequest, BatchResult, Choice, PositionLogprobs, RowError,
                                       TokenLogprob)
from engine_service.detokenizer import texts_of_tokens
from engine_service.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("pagoda.batch")

Emit = Callable[[BatchRequest, "BatchResult | RowError"], None]


def apply_chat_template(tokenizer, messages: list[dict]) -> list[int]:
    """The conversation rendered with the model's chat template, as prompt token ids."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 -- a template's own error (bad role order, ...) is the row's
        raise RowError("invalid_request", f"messages could not be rendered with the chat template: {e}") from None
    return tokenizer.encode(text, add_special_tokens=False)


def with_echo(req: BatchRequest, result: BatchResult, tokenizer: Callable[[], object],
              prompt_token_ids: list[int] | None = None) -> BatchResult:
    """An echo row's result with the prompt's text (a token-id prompt decoded, special tokens kept)
    and, when logprobs are asked, its first token's text. ``tokenizer()`` gives the model's
    tokenizer (loaded only when needed); ``prompt_token_ids``, where known, spare encoding the prompt."""
    if not req.echo:
        return result
    if isinstance(req.prompt, str):
        result.prompt_text = req.prompt
    else:
        result.prompt_text = tokenizer().decode(req.prompt, skip_special_tokens=False,
                                                clean_up_tokenization_spaces=False)
    if req.params.logprobs is not None:
        ids = prompt_token_ids or (req.prompt if isinstance(req.prompt, list) else tokenizer().encode(req.prompt))
        result.first_prompt_token = texts_of_tokens(tokenizer(), ids[:1])[0]
    return result


# ---- in process -----------------------------------------------------------------------------------

class LocalBackend:
    """Runs requests on an ``LLMEngine`` in this process with up to ``max_in_flight`` at once.

    The engine schedules what it holds by continuous batching (``max_num_seqs`` run together,
    the rest wait in its queue), so keeping it fed beyond ``max_num_seqs`` keeps every step full;
    the bound keeps memory flat however long the input is.
    """

    def __init__(self, engine, max_in_flight: int | None = None):
        self.engine = engine
        self.max_in_flight = max_in_flight or 2 * engine.config.max_num_seqs
        self.model_name = None
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]

    def run(self, requests: Iterator[BatchRequest], emit: Emit) -> None:
        engine = self.engine
        in_flight: dict[str, BatchRequest] = {}
        pending = iter(requests)
        exhausted = False
        try:
            while True:
                while not exhausted and len(in_flight) < self.max_in_flight:
                    req = next(pending, None)
                    if req is None:
                        exhausted = True
                        break
                    request_id = f"batch-{self._prefix}-{next(self._ids)}"
                    try:
                        prompt = (apply_chat_template(engine.tokenizer, req.messages) if req.endpoint == "chat"
                                  else req.prompt)
                        req.params.output_kind = RequestOutputKind.FINAL_ONLY  # only finished rows are written
                        engine.add_request(request_id, prompt, req.params)
                    except RowError as e:
                        emit(req, e)
                        continue
                    except ValueError as e:
                        emit(req, RowError("invalid_request", str(e)))
                        continue
                    in_flight[request_id] = req
                if not in_flight:
                    return
                for out in engine.step():
                    if out.finished:
                        req = in_flight.pop(out.request_id)
                        emit(req, with_echo(req, _result_from_output(out, req.params), lambda: engine.tokenizer,
                                            out.prompt_token_ids))
        finally:
            if in_flight:
                engine.abort_request(list(in_flight))


def _result_from_output(out, params: SamplingParams) -> BatchResult:
    choices = [Choice(c.index, c.text, c.finish_reason, len(c.token_ids),
                      None if c.logprobs is None else _positions(c.token_ids, c.logprobs, params.logprobs))
               for c in out.outputs]
    prompt_logprobs = None
    if out.prompt_logprobs is not None:
        prompt_logprobs = [None, *_positions(out.prompt_token_ids[1:], out.prompt_logprobs[1:], params.prompt_logprobs)]
    return BatchResult(out.request_id, choices, len(out.prompt_token_ids),
                       sum(c.num_tokens for c in choices), out.num_cached_tokens, prompt_logprobs)


def _positions(token_ids: list[int], entries: list[dict], k: int) -> list[PositionLogprobs]:
    """The engine's ``{token id: Logprob}`` entries (the top k first, by rank, then the token's own
    where it is not among them) as ``PositionLogprobs``."""
    def token(token_id: int, lp) -> TokenLogprob:
        return TokenLogprob(token_id, lp.decoded_token or "", lp.logprob, lp.rank)

    return [PositionLogprobs(token(tid, entry[tid]), [token(t, lp) for t, lp in itertools.islice(entry.items(), k)])
            for tid, entry in zip(token_ids, entries)]


def _positions_from_proto(messages) -> list[PositionLogprobs]:
    """``pagoda.v1.PositionLogprobs`` messages as ``PositionLogprobs``."""
    def token(t) -> TokenLogprob:
        return TokenLogprob(t.token_id, t.token, t.logprob, t.rank if t.HasField("rank") else None)

    return [PositionLogprobs(token(m.sampled), [token(t) for t in m.top]) for m in messages]


# ---- through gRPC ---------------------------------------------------------------------------------

class BackendUnavailable(Exception):
    """The remote service stayed unavailable through every retry: the job stops, the rows in flight are
    not written (a re-run does them)."""


class GenerateClient(abc.ABC):
    """One remote service's Generate call, for the rows of a batch job."""

    model_name: str = "pagoda"
    tokenizer_dir: str | None = None  # the model's tokenizer here, for what needs it on this side
    _tokenizer = None

    async def connect(self) -> None:
        """Open the channel and learn what is served (called once, before any ``generate``)."""

    def tokenizer(self, what: str):
        """The model's tokenizer (loaded once); RowError naming ``what`` needs it when there is none here."""
        if self._tokenizer is None:
            if self.tokenizer_dir is None:
                through = self.__class__.__name__.removesuffix("Client").lower()
                raise RowError("invalid_request", f"{what} through --{through} need the model's tokenizer here "
                                                  "(--tokenizer DIR)")
            from engine_service.model_loader import load_tokenizer

            self._tokenizer = load_tokenizer(self.tokenizer_dir)
        return self._tokenizer

    @abc.abstractmethod
    async def generate(self, req: BatchRequest, request_id: str) -> BatchResult:
        """Run one request to its end. Raises ``grpc.aio.AioRpcError`` or ``RowError``."""

    async def close(self) -> None:
        """Close the channel."""


def sampling_params_to_proto(params: SamplingParams):
    """The engine's SamplingParams as ``pagoda.v1.SamplingParams`` (unset where the default applies)."""
    from pagoda.v1 import common_pb2

    p = common_pb2.SamplingParams(
        n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, stop=params.stop, stop_token_ids=params.stop_token_ids,
        include_stop_str_in_output=params.include_stop_str_in_output, ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens, skip_special_tokens=params.skip_special_tokens)
    if params.seed is not None:
        p.seed = params.seed
    if params.max_tokens is not None:
        p.max_tokens = params.max_tokens
    if params.logprobs is not None:
        p.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        p.prompt_logprobs = params.prompt_logprobs
    if params.truncate_prompt_tokens is not None:
        p.truncate_prompt_tokens = params.truncate_prompt_tokens
    if params.logit_bias:
        p.logit_bias.update(params.logit_bias)
    if params.allowed_token_ids:
        p.allowed_token_ids.extend(params.allowed_token_ids)
    if params.bad_words:
        p.bad_words.extend(params.bad_words)
    so = params.structured_outputs
    if so is not None:
        kind = so.kind
        value = getattr(so, kind)
        target = p.structured_outputs
        if kind == "choice":
            target.choice.choices.extend(value)
        elif kind == "json":
            target.json = value if isinstance(value, str) else json.dumps(value)
        else:
            setattr(target, kind, value)
        target.disable_any_whitespace = so.disable_any_whitespace
    return p


_FINISH_REASON_NAMES = {1: "stop", 2: "length", 3: "abort"}


class _Streams:
    """The deltas of a request's ``n`` completions, gathered from a Generate stream."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.texts: dict[int, list[str]] = {}
        self.num_tokens: dict[int, int] = {}
        self.logprobs: dict[int, list[PositionLogprobs]] = {}
        self.reasons: dict[int, str] = {}
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None

    def prompt(self, messages) -> None:
        if messages:
            self.prompt_logprobs = [None, *_positions_from_proto(messages)]

    def add(self, index: int, text: str, token_ids, logprobs, finish_reason: str | None) -> None:
        self.texts.setdefault(index, []).append(text)
        self.num_tokens[index] = self.num_tokens.get(index, 0) + len(token_ids)
        self.logprobs.setdefault(index, []).extend(_positions_from_proto(logprobs))
        if finish_reason:
            self.reasons[index] = finish_reason

    def result(self, request_id: str, usage) -> BatchResult:
        want_logprobs = self.params.logprobs is not None
        choices = [Choice(i, "".join(self.texts.get(i, [])), self.reasons.get(i), self.num_tokens.get(i, 0),
                          self.logprobs.get(i, []) if want_logprobs else None) for i in range(self.params.n)]
        prompt_logprobs = self.prompt_logprobs
        if self.params.prompt_logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = [None]  # a one-token prompt
        return BatchResult(request_id, choices, usage.prompt_tokens, usage.completion_tokens,
                           usage.cached_prompt_tokens, prompt_logprobs)


async def _until_serving(call, target: str, timeout_s: float = 600.0):
    """``await call()``, retried while the service answers UNAVAILABLE (still loading its model)."""
    import grpc

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            return await call()
        except grpc.aio.AioRpcError as e:
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) \
                    or loop.time() > deadline:
                raise BackendUnavailable(f"{target}: {e.code().name}: {e.details()}") from None
            await asyncio.sleep(0.5)


class EngineClient(GenerateClient):
    """``pagoda.v1.Engine/Generate`` on one engine service. It takes a prompt or token ids, so chat
    rows are rendered here with the model's chat template: from ``tokenizer`` (a directory), else
    from the directory the engine reports in ModelInfo when it exists on this machine."""

    def __init__(self, target: str, tokenizer: str | None = None):
        self.target = target
        self.tokenizer_dir = tokenizer
        self._channel = None
        self._stub = None

    async def connect(self) -> None:
        import grpc

        from pagoda.v1 import engine_pb2, engine_pb2_grpc

        self._channel = grpc.aio.insecure_channel(self.target)
        self._stub = engine_pb2_grpc.EngineStub(self._channel)
        info = await _until_serving(lambda: self._stub.ModelInfo(engine_pb2.ModelInfoRequest(), wait_for_ready=True,
                                                                 timeout=60), self.target)
        self.model_name = info.model_id
        if self.tokenizer_dir is None and os.path.isdir(info.tokenizer):
            self.tokenizer_dir = info.tokenizer

    async def generate(self, req: BatchRequest, request_id: str) -> BatchResult:
        from pagoda.v1 import engine_pb2

        prompt = apply_chat_template(self.tokenizer("chat rows"), req.messages) if req.endpoint == "chat" else req.prompt
        fields = {"text": prompt} if isinstance(prompt, str) else {"prompt_token_ids": engine_pb2.TokenIds(ids=prompt)}
        message = engine_pb2.EngineGenerateRequest(request_id=request_id, sampling_params=sampling_params_to_proto(req.params), **fields)
        streams = _Streams(req.params)
        final = None
        async for response in self._stub.Generate(message):
            streams.prompt(response.prompt_logprobs)
            for chunk in response.chunks:
                streams.add(chunk.index, chunk.text, chunk.token_ids, chunk.logprobs,
                            _FINISH_REASON_NAMES.get(chunk.finish_reason, "stop") if chunk.finish_reason else None)
            if response.finished:
                final = response
        if final is None:
            raise RowError("engine_error", "the engine's stream ended without a final message")
        return streams.result(request_id, final.usage)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


class RouterClient(GenerateClient):
    """``pagoda.v1.Router/Generate`` on a Pagoda cluster: prompts, token ids or chat messages (the
    router renders them); one response per completion delta, the last with usage."""

    def __init__(self, target: str, tokenizer: str | None = None):
        self.target = target
        self.tokenizer_dir = tokenizer
        self._channel = None
        self._stub = None

    async def connect(self) -> None:
        import grpc

        try:
            from pagoda.v1 import router_pb2, router_pb2_grpc
        except ImportError:
            raise SystemExit("--router needs the Router API stubs (pagoda.v1.router_pb2), which this build "
                             "does not have; use --engine HOST:PORT to run against one engine service") from None
        self._pb2 = router_pb2
        self._channel = grpc.aio.insecure_channel(self.target)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        models = await _until_serving(lambda: self._stub.ListModels(router_pb2.ListModelsRequest(),
                                                                    wait_for_ready=True, timeout=60), self.target)
        if models.models:
            self.model_name = models.models[0].id

    async def generate(self, req: BatchRequest, request_id: str) -> BatchResult:
        pb2 = self._pb2
        fields = {}
        if req.endpoint == "chat":
            fields["messages"] = pb2.ChatMessages(messages=[pb2.ChatMessage(role=m["role"], content=m["content"])
                                                            for m in req.messages])
        elif isinstance(req.prompt, str):
            fields["prompt"] = req.prompt
        else:
            fields["prompt_token_ids"] = pb2.PromptTokenIds(ids=req.prompt)
        # A row's body.model is echoed in its output, not sent: batch files name OpenAI models
        # ("gpt-4o-mini") that the router would refuse; a cluster serving several models would
        # need a flag to route by it.
        message = pb2.GenerateRequest(request_id=request_id, sampling=sampling_params_to_proto(req.params), **fields)
        streams = _Streams(req.params)
        final = None
        async for response in self._stub.Generate(message):
            streams.prompt(response.prompt_logprobs)
            streams.add(response.index, response.text, response.token_ids, response.logprobs,
                        response.finish_reason or None)
            if response.finished:
                final = response
        if final is None:
            raise RowError("router_error", "the router's stream ended without a final message")
        return streams.result(final.request_id or request_id, final.usage)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


class RemoteBackend:
    """Runs requests through a ``GenerateClient`` with at most ``concurrency`` streams open.

    UNAVAILABLE and RESOURCE_EXHAUSTED (a full queue, an engine restarting) are retried with
    backoff, from scratch: nothing of a row is written before its stream ends. Past
    ``max_retries`` the job stops (``BackendUnavailable``). Other gRPC errors (INVALID_ARGUMENT
    for a prompt that is too long or a bad schema, ...) become that row's error.
    """

    def __init__(self, client: GenerateClient, concurrency: int = 64, max_retries: int = 6,
                 retry_backoff_s: float = 0.5):
        self.client = client
        self.concurrency = concurrency
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.model_name = None
        self._prefix = uuid.uuid4().hex[:8]

    def run(self, requests: Iterator[BatchRequest], emit: Emit) -> None:
        asyncio.run(self._run(requests, emit))

    async def _run(self, requests: Iterator[BatchRequest], emit: Emit) -> None:
        await self.client.connect()
        self.model_name = self.client.model_name
        slots = asyncio.Semaphore(self.concurrency)
        tasks: set[asyncio.Task] = set()
        failure: list[BaseException] = []

        async def one(n: int, req: BatchRequest) -> None:
            try:
                result = await self._generate(req, f"batch-{self._prefix}-{n}")
            except RowError as e:
                emit(req, e)
            except BaseException as e:  # noqa: BLE001 -- stops the job below
                failure.append(e)
            else:
                emit(req, result)
            finally:
                slots.release()

        try:
            for n, req in enumerate(requests):
                await slots.acquire()
                if failure:
                    break
                task = asyncio.create_task(one(n, req))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks and not failure:
                await asyncio.wait(set(tasks), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            await self.client.close()
        if failure:
            raise failure[0]

    async def _generate(self, req: BatchRequest, request_id: str) -> BatchResult:
        import grpc

        retryable = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)

        def tokenizer():
            return self.client.tokenizer("echo rows with logprobs or token-id prompts")

        if req.echo and (req.params.logprobs is not None or not isinstance(req.prompt, str)):
            tokenizer()  # a row that cannot be echoed here fails before it runs
        for attempt in itertools.count():
            try:
                result = await self.client.generate(req, f"{request_id}-{attempt}" if attempt else request_id)
                return with_echo(req, result, tokenizer)
            except grpc.aio.AioRpcError as e:
                if e.code() not in retryable:
                    # The same code as the in-process path for the same bad row.
                    code = "invalid_request" if e.code() == grpc.StatusCode.INVALID_ARGUMENT else e.code().name.lower()
                    raise RowError(code, e.details() or e.code().name) from None
                if attempt >= self.max_retries:
                    raise BackendUnavailable(f"{self.client.__class__.__name__} {getattr(self.client, 'target', '')}: "
                                             f"{e.code().name} after {attempt + 1} tries: {e.details()}") from None
                delay = min(self.retry_backoff_s * 2 ** attempt, 10.0)
                logger.warning("row %s: %s (%s); retrying in %.1f s", req.key, e.code().name, e.details(), delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")
