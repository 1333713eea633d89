"""Command line: ``python -m engine_service demo`` (offline generation with the bundled model) and
``python -m engine_service serve`` (the engine gRPC service).

Every ``serve`` option can also come from the environment, for containers: ``--max-num-seqs`` is
``PAGODA_MAX_NUM_SEQS``, ``--model`` is ``PAGODA_MODEL``, and so on (the command line wins).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time

from engine_service.config import KV_CACHE_DTYPE_CHOICES
from engine_service.config import parse_bytes as config_parse_bytes

DEMO_PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "The future of AI is",
    "def fibonacci(n):",
]


def demo(args: argparse.Namespace) -> None:
    from engine_service import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype)
    params = SamplingParams(temperature=args.temperature, top_p=0.95, max_tokens=args.max_tokens, seed=args.seed)
    t0 = time.perf_counter()
    outputs = llm.generate(DEMO_PROMPTS, params)
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    for out in outputs + chat:
        c = out.outputs[0]
        prompt = out.prompt if out.prompt is not None else "[chat] What is the capital of France?"
        print(f"\n--- {prompt!r}\n{c.text}\n[finish_reason={c.finish_reason}, {len(c.token_ids)} tokens]")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs + chat)
    print(f"\n{tokens} tokens in {elapsed:.1f} s ({tokens / elapsed:.1f} tok/s)")


def parse_bytes(text: str) -> int:
    """``4294967296``, ``4GiB``, ``512MiB``, ``1.5G`` -> bytes, for argparse."""
    try:
        return config_parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_serve_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="serve the engine over gRPC (options also from PAGODA_* variables)")
    s.add_argument("--model", default="bundled", help="'bundled', a HF directory or a .gguf file")
    s.add_argument("--served-model-name", default=None, help="model id reported by ModelInfo and metrics")
    s.add_argument("--host", default="0.0.0.0")
    s.add_argument("--port", type=int, default=50051)
    s.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port")
    s.add_argument("--log-level", default="INFO")
    e = s.add_argument_group("engine (vLLM's names)")
    e.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: 64 on CPU, 16 on GPU)")
    e.add_argument("--kv-cache-memory-bytes", type=parse_bytes, default=None, help="CPU KV budget, e.g. 4GiB")
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    e.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    e.add_argument("--kv-cache-prefault", action=argparse.BooleanOptionalAction, default=True,
                   help="CPU: write the whole KV cache at start-up (~1 s per GiB) instead of faulting it in during steps")
    e.add_argument("--cpu-bf16-gemm", action=argparse.BooleanOptionalAction, default=True,
                   help="CPU with AVX512-BF16 or AMX, bf16: the decoder layers' GEMMs on Pagoda's own kernels "
                        "with silu*up and rotary + KV write fused (with AMX, over 1024 rows on oneDNN)")
    e.add_argument("--cpu-f32-gemm", action=argparse.BooleanOptionalAction, default=None,
                   help="float32 weights: the decoder layers' GEMMs on Pagoda's own FMA kernel (AVX-512 or AVX2) "
                        "with silu*up and rotary + KV write fused (default: on wherever the CPU has AVX2 and FMA)")
    e.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                   help="one byte a K/V value, fp8 (= fp8_e4m3) or fp8_e5m2: half the attention reads, twice the "
                        "tokens a budget holds")
    e.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    e.add_argument("--swap-space-bytes", type=parse_bytes, default=1 << 30)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--device", default="cpu")
    e.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    e.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="speculative decoding by prompt lookup: draft tokens verified per step (0: off)")
    e.add_argument("--prompt-lookup-max", type=int, default=3, help="longest n-gram the lookup matches")
    e.add_argument("--prompt-lookup-min", type=int, default=1, help="shortest n-gram the lookup matches")
    v = s.add_argument_group("service")
    v.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="beyond this many waiting requests Generate returns RESOURCE_EXHAUSTED")
    v.add_argument("--max-stream-buffer", type=int, default=1024,
                   help="outputs a stream may fall behind before it is cut off and its request aborted")
    v.add_argument("--stall-timeout", type=float, default=60.0,
                   help="seconds without engine loop progress (while it has work) before health is NOT_SERVING")
    v.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds to drain streams on SIGTERM")
    v.add_argument("--tls-cert", default=None, help="serve TLS with this certificate (PEM) ...")
    v.add_argument("--tls-key", default=None, help="... and this private key (PEM)")
    v.add_argument("--tls-client-ca", default=None,
                   help="require client certificates signed by this CA (mutual TLS with the routers)")
    r = s.add_argument_group("router fleet registration (engines are found through Redis)")
    r.add_argument("--redis-url", default=None, help="heartbeat this engine's load into the registry at this "
                   "Redis (redis://[:password@]host:port/db or rediss://); unset: not registered")
    r.add_argument("--redis-password-file", default=None, help="Redis password from a file (or PAGODA_REDIS_PASSWORD)")
    r.add_argument("--redis-ca", default=None, help="CA certificate for rediss:// URLs")
    r.add_argument("--namespace", default="pagoda", help="registry/queue key prefix shared with the routers")
    r.add_argument("--engine-id", default=None, help="registry id (default: the advertised address)")
    r.add_argument("--advertise-address", default=None,
                   help="host:port routers dial (default: this host's name and --port)")
    r.add_argument("--heartbeat-interval", type=float, default=0.25, help="seconds between load heartbeats")
    r.add_argument("--heartbeat-ttl", type=float, default=2.0,
                   help="seconds after the last heartbeat before routers drop this engine")
    s.set_defaults(func=serve)
    return s


def apply_env_defaults(parser: argparse.ArgumentParser, prefix: str = "PAGODA_") -> None:
    """Defaults from ``PAGODA_<OPTION>`` variables, converted and checked like command-line values."""
    for action in parser._actions:
        value = os.environ.get(prefix + action.dest.upper())
        if value is None or not action.option_strings or action.dest == "help":
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            converted = value.strip().lower() in ("1", "true", "yes", "on")
        else:
            try:
                converted = action.type(value) if action.type else value
            except (ValueError, argparse.ArgumentTypeError) as e:
                parser.error(f"{prefix}{action.dest.upper()}={value!r}: {e}")
            if action.choices and converted not in action.choices:
                parser.error(f"{prefix}{action.dest.upper()}={value!r}: choose from {', '.join(action.choices)}")
        parser.set_defaults(**{action.dest: converted})


ENGINE_OPTIONS = ("dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                  "kv_cache_memory_bytes", "gpu_memory_utilization", "enable_prefix_caching",
                  "enable_chunked_prefill", "preemption_mode", "swap_space_bytes", "seed", "device",
                  "attention_backend", "kv_cache_prefault", "cpu_bf16_gemm", "cpu_f32_gemm", "num_speculative_tokens",
                  "prompt_lookup_max", "prompt_lookup_min", "kv_cache_dtype")


def serve(args: argparse.Namespace) -> None:
    from engine_service.config import EngineConfig
    from engine_service.server import EngineServer
    from router.logs import configure_logging

    configure_logging(args.log_level)
    config = EngineConfig(model=args.model, **{name: getattr(args, name) for name in ENGINE_OPTIONS})
    credentials = None
    if args.tls_cert or args.tls_key:
        from router.security import server_credentials

        credentials = server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)
    server = EngineServer(config, host=args.host, port=args.port, metrics_port=args.metrics_port,
                          served_model_name=args.served_model_name,
                          max_waiting_requests=args.max_waiting_requests, max_stream_buffer=args.max_stream_buffer,
                          stall_timeout_s=args.stall_timeout, shutdown_grace_s=args.shutdown_grace,
                          server_credentials=credentials)
    asyncio.run(_serve(server, args))
    # Past this line only the interpreter's own exit is left: a process that outlives it by much is
    # stuck in a thread or an atexit hook (`kill -USR1` shows which).
    logging.getLogger("pagoda.engine_service").info("server.exiting")


async def _serve(server, args: argparse.Namespace) -> None:
    from router.lifecycle import install_stack_dumps

    install_stack_dumps()  # `kill -USR1 <pid>`: every thread's and every asyncio task's stack to stderr
    await (_serve_registered(server, args) if args.redis_url else server.serve())


async def _serve_registered(server, args: argparse.Namespace) -> None:
    """Serve, heartbeating into the router fleet's registry from when the model is loaded until shutdown."""
    from engine_service.registration import EngineRegistration

    password = os.environ.get("PAGODA_REDIS_PASSWORD")
    if args.redis_password_file:
        with open(args.redis_password_file, encoding="utf-8") as f:
            password = f.read().strip()
    registration = EngineRegistration(
        server, args.redis_url, engine_id=args.engine_id, advertise_address=args.advertise_address,
        namespace=args.namespace, redis_password=password, redis_ca=args.redis_ca,
        interval_s=args.heartbeat_interval, ttl_s=args.heartbeat_ttl)
    serving = asyncio.create_task(server.serve())
    try:
        while not server.engine.ready and not serving.done():
            await asyncio.sleep(0.05)
        if not serving.done():
            await registration.start()
        await serving
    finally:
        await registration.stop()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m engine_service")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="generate for a few prompts and one chat with the bundled model")
    d.add_argument("--model", default=None, help="'bundled' (default), a HF directory or a .gguf file")
    d.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    d.add_argument("--max-tokens", type=int, default=48)
    d.add_argument("--temperature", type=float, default=0.8)
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=demo)
    apply_env_defaults(add_serve_parser(sub))
    return ap


def main() -> None:
    args = build_parser().parse_args()
    if args.command != "serve":
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.func(args)


if __name__ == "__main__":
    main()
