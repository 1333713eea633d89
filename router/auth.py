"""Bearer-token check on the router's public API, as a gRPC server interceptor.

A call without ``authorization`` metadata ends with UNAUTHENTICATED, one with a token that matches
none of the configured ones with PERMISSION_DENIED, before any handler runs (so nothing reaches the
queue). Tokens are compared with ``hmac.compare_digest`` against every configured token (no early
exit, so the time taken does not depend on which token or how much of it matched) and are never
logged. Health checks stay open for load balancers.
"""
from __future__ import annotations

import hmac

import grpc
import structlog

logger = structlog.get_logger("pagoda.router.auth")

OPEN_METHODS = ("/grpc.health.v1.Health/",)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: tuple[str, ...], open_methods: tuple[str, ...] = OPEN_METHODS):
        if not tokens or any(not t for t in tokens):
            raise ValueError("auth needs at least one non-empty token")
        self._tokens = [t.encode() for t in tokens]
        self._open = open_methods

    def check(self, metadata) -> tuple[grpc.StatusCode, str] | None:
        """None if ``metadata`` carries a valid bearer token, else the refusal."""
        value = next((v for k, v in metadata or () if k == "authorization"), None)
        if value is None:
            return grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization' metadata: send 'Bearer <token>'"
        scheme, _, token = (value if isinstance(value, str) else value.decode("latin-1")).partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return grpc.StatusCode.UNAUTHENTICATED, "the 'authorization' metadata must be 'Bearer <token>'"
        candidate = token.strip().encode()
        matched = False
        for known in self._tokens:
            matched |= hmac.compare_digest(known, candidate)
        return None if matched else (grpc.StatusCode.PERMISSION_DENIED, "the bearer token is not valid")

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(self._open):
            return await continuation(handler_call_details)
        refusal = self.check(handler_call_details.invocation_metadata)
        if refusal is None:
            return await continuation(handler_call_details)
        code, message = refusal
        logger.info("auth.refused", method=method, code=code.name)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None

        async def deny(request, context):
            await context.abort(code, message)

        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            if getattr(handler, kind) is not None:
                factory = getattr(grpc, f"{kind}_rpc_method_handler")
                return factory(deny, request_deserializer=handler.request_deserializer,
                               response_serializer=handler.response_serializer)
        return None
