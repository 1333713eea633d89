"""Command line of the router.

    python -m router serve --redis-url redis://localhost:6379/0 --port 50050   # the router service
    python -m router generate --target localhost:50050 "The capital of France is"
    python -m router stack                                                    # redis + engine + router + demo

Every ``serve`` option also comes from ``PAGODA_ROUTER_<OPTION>`` (``--max-queue-size`` is
``PAGODA_ROUTER_MAX_QUEUE_SIZE``); the command line wins. Secrets never go on the command line:
bearer tokens come from ``--auth-token-file`` or ``PAGODA_ROUTER_AUTH_TOKENS`` (comma-separated),
the Redis password from ``--redis-password-file`` or ``PAGODA_REDIS_PASSWORD``.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys



def apply_env_defaults(parser: argparse.ArgumentParser, prefix: str) -> None:
    """Defaults from ``{prefix}<OPTION>`` variables, converted and checked like command-line values.
    (The engine's CLI has the same rule; not imported from there because that loads torch.)"""
    for action in parser._actions:
        value = os.environ.get(prefix + action.dest.upper())
        if value is None or not action.option_strings or action.dest == "help":
            continue
        try:
            converted = action.type(value) if action.type else value
        except (ValueError, argparse.ArgumentTypeError) as e:
            parser.error(f"{prefix}{action.dest.upper()}={value!r}: {e}")
        parser.set_defaults(**{action.dest: converted})

SERVE_OPTIONS = ("redis_url", "redis_ca", "namespace", "host", "port", "metrics_port", "tokenizer",
                 "max_queue_size", "max_queued_tokens", "max_queue_wait_boost_s", "priority_step_s", "max_skips",
                 "affinity_slack", "engine_max_waiting", "max_batch_size", "max_request_bytes", "max_attempts",
                 "lease_ttl_s", "engine_fault_backoff_s", "redis_outage_grace_s", "slo_window_s",
                 "slo_min_samples", "shutdown_grace_s", "tls_cert", "tls_key", "tls_client_ca", "engine_tls_ca", "engine_tls_cert",
                 "engine_tls_key")


def add_serve_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="serve the Router API (options also from PAGODA_ROUTER_* variables)")
    s.add_argument("--redis-url", default="redis://127.0.0.1:6379/0",
                   help="redis://[:password@]host:port/db, or rediss:// for TLS")
    s.add_argument("--redis-password-file", default=None, help="Redis password from a file (or PAGODA_REDIS_PASSWORD)")
    s.add_argument("--redis-ca", default=None, help="CA certificate for rediss://")
    s.add_argument("--namespace", default="pagoda", help="key prefix shared with the engines and other routers")
    s.add_argument("--host", default="0.0.0.0")
    s.add_argument("--port", type=int, default=50050)
    s.add_argument("--metrics-port", type=int, default=9091, help="Prometheus /metrics port (-1: none)")
    s.add_argument("--router-id", default=None, help="this router's id in the queue's leases (default: unique)")
    s.add_argument("--tokenizer", default=None, help="directory with tokenizer.json (default: the engines' own)")
    s.add_argument("--log-level", default="INFO")
    q = s.add_argument_group("queue and admission")
    q.add_argument("--max-queue-size", type=int, default=1024)
    q.add_argument("--max-queued-tokens", type=int, default=1 << 22)
    q.add_argument("--max-queue-wait-boost-s", type=float, default=30.0,
                   help="aging bound: a request that waited this long outranks any newer one")
    q.add_argument("--priority-step-s", type=float, default=1.0, help="seconds of precedence per priority unit")
    q.add_argument("--max-skips", type=int, default=8, help="most times a request may be overtaken by smaller ones")
    q.add_argument("--affinity-slack", type=float, default=0.25)
    q.add_argument("--engine-max-waiting", type=int, default=0,
                   help="requests admitted to an engine beyond its max_num_seqs")
    q.add_argument("--max-batch-size", type=int, default=1024)
    q.add_argument("--max-request-bytes", type=int, default=4 << 20)
    q.add_argument("--max-attempts", type=int, default=4)
    f = s.add_argument_group("faults")
    f.add_argument("--lease-ttl-s", type=float, default=5.0)
    f.add_argument("--engine-fault-backoff-s", type=float, default=2.0)
    f.add_argument("--redis-outage-grace-s", type=float, default=3.0)
    f.add_argument("--slo-window-s", type=float, default=30.0, help="admission-rate window of the deadline check")
    f.add_argument("--slo-min-samples", type=int, default=8, help="admissions needed before the deadline check applies")
    f.add_argument("--shutdown-grace-s", type=float, default=30.0)
    t = s.add_argument_group("security")
    t.add_argument("--tls-cert", default=None)
    t.add_argument("--tls-key", default=None)
    t.add_argument("--tls-client-ca", default=None, help="require client certificates signed by this CA")
    t.add_argument("--engine-tls-ca", default=None, help="dial engines over TLS trusting this CA")
    t.add_argument("--engine-tls-cert", default=None, help="client certificate for engines (mTLS)")
    t.add_argument("--engine-tls-key", default=None)
    t.add_argument("--auth-token-file", default=None,
                   help="bearer tokens, one per line (also PAGODA_ROUTER_AUTH_TOKENS, comma-separated)")
    s.set_defaults(func=serve)
    return s


def serve(args: argparse.Namespace) -> None:
    from router.config import RouterConfig
    from router.logs import configure_logging
    from router.security import load_tokens
    from router.server import RouterServer

    configure_logging(args.log_level)
    options = {name: getattr(args, name) for name in SERVE_OPTIONS}
    if options["metrics_port"] is not None and options["metrics_port"] < 0:
        options["metrics_port"] = None
    password = os.environ.get("PAGODA_REDIS_PASSWORD")
    if args.redis_password_file:
        with open(args.redis_password_file, encoding="utf-8") as f:
            password = f.read().strip()
    if args.router_id:
        options["router_id"] = args.router_id
    config = RouterConfig(redis_password=password, auth_tokens=load_tokens(args.auth_token_file,
                                                                          "PAGODA_ROUTER_AUTH_TOKENS"), **options)
    asyncio.run(_serve(RouterServer(config)))


async def _serve(server) -> None:
    from router.lifecycle import install_stack_dumps

    install_stack_dumps()  # `kill -USR1 <pid>`: every thread's and every asyncio task's stack to stderr
    await server.serve()


def generate(args: argparse.Namespace) -> None:
    import grpc

    from router.client import RouterClient

    token = args.token or os.environ.get("PAGODA_ROUTER_TOKEN")
    root = open(args.ca, "rb").read() if args.ca else None
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    with RouterClient(args.target, token=token, tls=args.tls or root is not None, root_certificates=root) as client:
        try:
            if args.stream:
                final = None
                for delta in client.stream(args.prompt, priority=args.priority, timeout=args.timeout, **sampling):
                    print(delta.text, end="", flush=True)
                    final = delta
                print()
                if final is not None and final.finished:
                    print(f"[finish_reason={final.finish_reason} prompt_tokens={final.usage.prompt_tokens} "
                          f"completion_tokens={final.usage.completion_tokens} "
                          f"queue={final.timings.queue_time_s * 1e3:.1f} ms ttft={final.timings.ttft_s * 1e3:.1f} ms "
                          f"e2e={final.timings.e2e_s * 1e3:.1f} ms]", file=sys.stderr)
            else:
                result = client.generate(args.prompt, priority=args.priority, timeout=args.timeout, **sampling)
                print(result.text)
                print(f"[finish_reason={result.outputs[0].finish_reason} prompt_tokens={result.usage.prompt_tokens} "
                      f"completion_tokens={result.usage.completion_tokens} "
                      f"queue={result.timings.queue_time_s * 1e3:.1f} ms ttft={result.timings.ttft_s * 1e3:.1f} ms "
                      f"e2e={result.timings.e2e_s * 1e3:.1f} ms]", file=sys.stderr)
        except grpc.RpcError as e:
            sys.exit(f"error: {e.code().name}: {e.details()}")


def stack(args: argparse.Namespace) -> None:
    from router.stack import main as stack_main

    stack_main(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m router")
    sub = ap.add_subparsers(dest="command", required=True)
    s = add_serve_parser(sub)
    apply_env_defaults(s, prefix="PAGODA_ROUTER_")
    g = sub.add_parser("generate", help="send one prompt to a router and print the answer")
    g.add_argument("prompt")
    g.add_argument("--target", default="localhost:50050", help="router host:port")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--priority", type=int, default=0)
    g.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    g.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    g.add_argument("--token", default=None, help="bearer token (or PAGODA_ROUTER_TOKEN)")
    g.add_argument("--tls", action="store_true", help="connect with TLS (system roots)")
    g.add_argument("--ca", default=None, help="connect with TLS trusting this CA certificate")
    g.set_defaults(func=generate)
    k = sub.add_parser("stack", help="local stack without Docker: redis-server, one engine, one router, demo prompts")
    k.add_argument("--model", default="bundled")
    k.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    k.add_argument("--max-tokens", type=int, default=32)
    k.add_argument("--keep-running", action="store_true", help="after the demo, serve until Ctrl-C")
    k.set_defaults(func=stack)
    return ap


def main() -> None:
    args = build_parser().parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
