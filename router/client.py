"""Python client SDK of the Router API, sync (`RouterClient`) and asyncio (`AsyncRouterClient`).

    client = RouterClient("localhost:50050", token="...")
    print(client.generate("The capital of France is", max_tokens=16, temperature=0).text)
    for delta in client.stream("Tell me a story", max_tokens=64):
        print(delta.text, end="", flush=True)

Retries only where safe: a call that failed with UNAVAILABLE (router or Redis away, no engine
could take it) or RESOURCE_EXHAUSTED (queue full) *before any response message arrived* is sent
again after an exponential backoff with jitter, ``max_retries`` times at most, within the call's
timeout. Nothing is retried once output has been received (it would be generated twice), nor
any other status (INVALID_ARGUMENT, DEADLINE_EXCEEDED, ...). A retried request keeps its
request_id, so the router's ALREADY_EXISTS check guards against running it twice.
"""
from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from pagoda.v1 import common_pb2, router_pb2, router_pb2_grpc

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
SAMPLING_FIELDS = {f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields}


@dataclass
class Completion:
    """One completion of a finished request (``n`` of them when sampling ``n > 1``)."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str = ""


@dataclass
class Result:
    """A finished request: vLLM's ``RequestOutput`` shape (``outputs[i].text``) plus usage and timings."""

    request_id: str
    outputs: list[Completion]
    usage: common_pb2.Usage
    timings: common_pb2.Timings
    prompt_logprobs: list = field(default_factory=list)  # PositionLogprobs of prompt tokens 1.., when asked

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []


def build_request(prompt: str | Sequence[int] | None = None, *, messages: Sequence[dict] | None = None,
                  request_id: str | None = None, priority: int = 0, model: str = "",
                  sampling: common_pb2.SamplingParams | None = None, **sampling_kwargs) -> router_pb2.GenerateRequest:
    """A ``GenerateRequest`` from a prompt string, token ids or chat ``messages`` and vLLM-named sampling kwargs."""
    unknown = set(sampling_kwargs) - SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling parameters: {sorted(unknown)}; expected {sorted(SAMPLING_FIELDS)}")
    if sampling is None:
        sampling = common_pb2.SamplingParams(**{k: v for k, v in sampling_kwargs.items() if v is not None})
    request = router_pb2.GenerateRequest(request_id=request_id or uuid.uuid4().hex, priority=priority, model=model,
                                         sampling=sampling)
    if messages is not None:
        request.messages.messages.extend(router_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    elif isinstance(prompt, str):
        request.prompt = prompt
    elif prompt is not None:
        request.prompt_token_ids.ids.extend(prompt)
    return request


class _Accumulator:
    def __init__(self, request_id: str):
        self.request_id = request_id
        self.outputs: dict[int, Completion] = {}
        self.usage = common_pb2.Usage()
        self.timings = common_pb2.Timings()
        self.prompt_logprobs: list = []

    def add(self, r: router_pb2.GenerateResponse) -> None:
        c = self.outputs.setdefault(r.index, Completion(index=r.index))
        c.text += r.text
        c.token_ids.extend(r.token_ids)
        c.logprobs.extend(r.logprobs)
        self.prompt_logprobs.extend(r.prompt_logprobs)
        if r.finish_reason:
            c.finish_reason = r.finish_reason
        if r.finished:
            self.usage.CopyFrom(r.usage)
            self.timings.CopyFrom(r.timings)

    def result(self) -> Result:
        return Result(self.request_id, [self.outputs[i] for i in sorted(self.outputs)], self.usage, self.timings,
                      self.prompt_logprobs)


def _metadata(token: str | None, metadata: Sequence[tuple[str, str]] | None) -> tuple:
    md = tuple(metadata or ())
    return md + ((("authorization", f"Bearer {token}"),) if token else ())


def _credentials(tls: bool, root_certificates: bytes | None, private_key: bytes | None,
                 certificate_chain: bytes | None) -> grpc.ChannelCredentials | None:
    if not (tls or root_certificates or certificate_chain):
        return None
    return grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)


class _Retry:
    """Backoff schedule of the safe retries."""

    def __init__(self, max_retries: int, backoff_s: float, timeout: float | None):
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.attempt = 0

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def next_delay(self, error: grpc.RpcError, received: bool) -> float | None:
        """Seconds to wait before the next attempt, or None to give up and raise."""
        if received or error.code() not in RETRYABLE or self.attempt >= self.max_retries:
            return None
        delay = self.backoff_s * (2 ** self.attempt) * (0.5 + random.random())
        self.attempt += 1
        remaining = self.remaining()
        if remaining is not None and delay >= remaining:
            return None
        return delay


class RouterClient:
    """Blocking client. ``target`` is host:port; ``token`` a bearer token; TLS with ``tls=True`` or a root CA."""

    def __init__(self, target: str, *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, private_key: bytes | None = None,
                 certificate_chain: bytes | None = None, max_retries: int = 3, backoff_s: float = 0.1,
                 options: Sequence[tuple] = ()):
        credentials = _credentials(tls, root_certificates, private_key, certificate_chain)
        self.channel = (grpc.secure_channel(target, credentials, options) if credentials is not None
                        else grpc.insecure_channel(target, options))
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self.token, self.max_retries, self.backoff_s = token, max_retries, backoff_s

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "RouterClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stream_request(self, request: router_pb2.GenerateRequest, *, timeout: float | None = None,
                       metadata: Sequence[tuple[str, str]] | None = None) -> Iterator[router_pb2.GenerateResponse]:
        """The response messages of one request as they arrive (safe retries included)."""
        retry = _Retry(self.max_retries, self.backoff_s, timeout)
        while True:
            received = False
            call = self.stub.Generate(request, timeout=retry.remaining(), metadata=_metadata(self.token, metadata))
            try:
                for response in call:
                    received = True
                    yield response
                return
            except grpc.RpcError as e:
                delay = retry.next_delay(e, received)
                if delay is None:
                    raise
                time.sleep(delay)
            finally:
                call.cancel()  # a consumer that stopped early: the router aborts the engine request

    def stream(self, prompt=None, *, timeout: float | None = None, metadata=None,
               **kwargs) -> Iterator[router_pb2.GenerateResponse]:
        """``stream_request(build_request(prompt, **kwargs))``: each delta (``.text``, ``.token_ids``)."""
        return self.stream_request(build_request(prompt, **kwargs), timeout=timeout, metadata=metadata)

    def generate(self, prompt=None, *, timeout: float | None = None, metadata=None, **kwargs) -> Result:
        """Generate and return the finished `Result` (kwargs: messages, request_id, priority, model, sampling)."""
        request = build_request(prompt, **kwargs)
        acc = _Accumulator(request.request_id)
        for response in self.stream_request(request, timeout=timeout, metadata=metadata):
            acc.add(response)
        return acc.result()

    def generate_batch(self, requests: Sequence[router_pb2.GenerateRequest], *, timeout: float | None = None,
                       metadata=None) -> Iterator[router_pb2.GenerateBatchResponse]:
        """Results as they complete (``.index`` into ``requests``). Not retried: items may have run."""
        return self.stub.GenerateBatch(router_pb2.GenerateBatchRequest(requests=requests), timeout=timeout,
                                       metadata=_metadata(self.token, metadata))

    def list_models(self, *, timeout: float | None = 10.0) -> list[router_pb2.ModelCard]:
        return list(self.stub.ListModels(router_pb2.ListModelsRequest(), timeout=timeout,
                                         metadata=_metadata(self.token, None)).models)


class AsyncRouterClient:
    """asyncio client with the same methods as `RouterClient` (``stream`` is an async iterator)."""

    def __init__(self, target: str, *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, private_key: bytes | None = None,
                 certificate_chain: bytes | None = None, max_retries: int = 3, backoff_s: float = 0.1,
                 options: Sequence[tuple] = ()):
        credentials = _credentials(tls, root_certificates, private_key, certificate_chain)
        self.channel = (grpc.aio.secure_channel(target, credentials, options) if credentials is not None
                        else grpc.aio.insecure_channel(target, options))
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self.token, self.max_retries, self.backoff_s = token, max_retries, backoff_s

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncRouterClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def stream_request(self, request: router_pb2.GenerateRequest, *, timeout: float | None = None,
                             metadata=None) -> AsyncIterator[router_pb2.GenerateResponse]:
        retry = _Retry(self.max_retries, self.backoff_s, timeout)
        while True:
            received = False
            call = self.stub.Generate(request, timeout=retry.remaining(), metadata=_metadata(self.token, metadata))
            try:
                async for response in call:
                    received = True
                    yield response
                return
            except grpc.aio.AioRpcError as e:
                delay = retry.next_delay(e, received)
                if delay is None:
                    raise
                await asyncio.sleep(delay)
            finally:
                call.cancel()  # a consumer that stopped early: the router aborts the engine request

    def stream(self, prompt=None, *, timeout: float | None = None, metadata=None,
               **kwargs) -> AsyncIterator[router_pb2.GenerateResponse]:
        return self.stream_request(build_request(prompt, **kwargs), timeout=timeout, metadata=metadata)

    async def generate(self, prompt=None, *, timeout: float | None = None, metadata=None, **kwargs) -> Result:
        request = build_request(prompt, **kwargs)
        acc = _Accumulator(request.request_id)
        async for response in self.stream_request(request, timeout=timeout, metadata=metadata):
            acc.add(response)
        return acc.result()

    async def generate_batch(self, requests: Sequence[router_pb2.GenerateRequest], *, timeout: float | None = None,
                             metadata=None) -> AsyncIterator[router_pb2.GenerateBatchResponse]:
        async for result in self.stub.GenerateBatch(router_pb2.GenerateBatchRequest(requests=requests),
                                                    timeout=timeout, metadata=_metadata(self.token, metadata)):
            yield result

    async def list_models(self, *, timeout: float | None = 10.0) -> list[router_pb2.ModelCard]:
        response = await self.stub.ListModels(router_pb2.ListModelsRequest(), timeout=timeout,
                                               metadata=_metadata(self.token, None))
        return list(response.models)
