"""Command line: ``python -m engine_service demo`` (offline generation with the bundled model)."""
from __future__ import annotations

import argparse
import logging
import time

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


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m engine_service")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="generate for a few prompts and one chat with the bundled model")
    d.add_argument("--model", default=None, help="'bundled' (default), a HF directory or a .gguf file")
    d.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    d.add_argument("--max-tokens", type=int, default=48)
    d.add_argument("--temperature", type=float, default=0.8)
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=demo)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.func(args)


if __name__ == "__main__":
    main()
