"""Pagoda's own GEMMs inside the engine's real decode step, claim by claim (time-stamp counter).

    python bench/gemm_trace.py [--requests 256] [--steps 5] [--dtype bfloat16] [--prefill]

Starts the first --requests prompts of W as bench/decode_step.py does, then runs --steps decode-only
steps with the layers in their one C++ call (as the engine runs them: bench/decode_step.py and
bench/parts.py run them from Python to time them, which adds costs of its own). The kernels' trace
(``torch.ops.pagoda_cpu.gemm_trace``: every claim of run_gemm_blocks with its start, the end of its
multiply and of its epilogue, and each thread's parallel region) is on only during those steps.
Prints, for each GEMM of a layer (QKV with rotary and the K/V write, o_proj, gate/up with silu * up,
down_proj) and the LM head: microseconds a call, the share of the call's threads' time spent inside
their claims, the multiply's GFLOP/s (per thread: compare with one core's peak, e.g.
``vdpbf16ps`` in bench/isa_rates.py: 64 FLOP an instruction), the epilogue's share, a thread's first
claim's rate against its later ones' (cold weights), and the time between one GEMM and the next
(RMSNorm; decode attention before o_proj). Needs a CPU where the layers run on Pagoda's GEMMs
(AVX512-BF16 or AMX in bf16, AVX2 in float32). Each call is named by its shape (the trace carries
each call's column blocks and K), so a GEMM that runs on oneDNN instead (on AMX, QKV, o_proj
and down_proj past ``AMX_GEMM_MAX_ROWS`` rows) is reported as not traced, not mistaken for another;
"before it" is then the time since the previous traced GEMM.

``--prefill`` traces W's first --steps steps instead, with all of W added at once as
bench/engine_runner.py adds it: each is a full step of prompt chunks (the step budget's 2048 tokens,
the first requests' decode rows beside them), the kind of step that takes half of a W run. The time
before o_proj is then the step's prefill and decode attention.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine_runner import load_workload, pagoda_adder, start_decoding, warm_up_pagoda  # noqa: E402

KINDS = ("qkv", "o_proj", "gate_up", "down")


def kind_of(blocks: int, group: int, k: int, cfg) -> str:
    """A GEMM call's name in a Llama layer stack from its shape: output 64-column blocks, blocks a
    group (2: gate/up interleaved) and K."""
    n, head_dim = 64 * blocks, cfg.hidden_size // cfg.num_attention_heads
    if n == cfg.vocab_size:
        return "lm_head"
    if group == 2:
        return "gate_up"
    if k == cfg.intermediate_size:
        return "down"
    if n == (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * head_dim:
        return "qkv"
    return "o_proj"


def tsc_hz(tsc) -> float:
    c0, t0 = tsc(), time.perf_counter()
    time.sleep(0.2)
    return (tsc() - c0) / (time.perf_counter() - t0)


def calls_of(trace: list[list[int]]) -> list[tuple[list[list[int]], list[list[int]]]]:
    """Splits one step's trace into calls, in order: (each thread's region row, the call's claims).
    A region row is [thread, -1, threads, start, end, column groups, K], a claim [thread, column
    group, rows, start, end of its multiply, end of its epilogue, 64-column blocks a group]."""
    regions = sorted((r for r in trace if r[1] == -1), key=lambda r: r[3])
    claims = sorted((r for r in trace if r[1] != -1), key=lambda r: r[3])
    calls, i = [], 0
    while i < len(regions):
        group = regions[i:i + regions[i][2]]
        i += len(group)
        lo, hi = min(r[3] for r in group), max(r[4] for r in group)
        calls.append((group, [c for c in claims if lo <= c[3] <= hi]))
    return calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256, help="the first N requests of W: the decode batch, or with --prefill the requests added")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"],
                    help="the engine's kv_cache_dtype (fp8 = e4m3, fp8_e5m2: one byte a K/V value; int8: codes and a scale a row)")
    ap.add_argument("--prefill", action="store_true",
                    help="trace W's first --steps steps (all of W added at once: prefill steps) instead")
    args = ap.parse_args()
    if not 1 <= args.requests <= 256 or args.steps < 1:
        ap.error("--requests must be in 1..256 and --steps >= 1")

    import torch

    from engine_service import LLM

    requests = load_workload("W")[:args.requests]
    engine = LLM(dtype=args.dtype, max_num_seqs=256, kv_cache_dtype=args.kv_cache_dtype).llm_engine
    runner = engine.runner
    if not (runner.bf16_gemm or runner.f32_gemm) or runner.model.layer_stack is None:
        sys.exit("the layers do not run on Pagoda's GEMMs in one C++ call on this CPU / dtype")
    warm_up_pagoda(engine, requests)
    if args.prefill:
        add = pagoda_adder(engine)
        for r in requests:
            add(r)
    else:
        start_decoding(engine, requests)
    schedule, step_tokens = engine.scheduler.schedule, []

    def counted():  # each traced step's token count
        out = schedule()
        step_tokens.append(sum(out.num_new_tokens))
        return out

    engine.scheduler.schedule = counted

    ops = torch.ops.pagoda_cpu
    hz = tsc_hz(ops.gemm_tsc)
    cfg = runner.model.config
    stats: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    step_s = []
    for _ in range(args.steps):
        ops.gemm_trace(True)
        t = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - t)
        calls = calls_of(ops.gemm_trace(False).tolist())
        prev_end = None
        for regions, claims in calls:
            groups, k = regions[0][5], regions[0][6]
            group = claims[0][6] if claims else 1
            kind = kind_of(groups * group, group, k, cfg)
            s = stats[kind]
            lo, hi = min(r[3] for r in regions), max(r[4] for r in regions)
            s["us"].append((hi - lo) / hz * 1e6)
            if prev_end is not None:
                s["gap_us"].append((lo - prev_end) / hz * 1e6)
            prev_end = hi
            busy = sum(c[5] - c[3] for c in claims)
            s["in_claims"].append(busy / sum(r[4] - r[3] for r in regions))
            mult = sum(c[4] - c[3] for c in claims)
            s["epilogue"].append(1 - mult / busy if busy else 0.0)
            flop = sum(2 * c[2] * k * 64 * group for c in claims)
            s["gflops_thread"].append(flop / (mult / hz) / 1e9)
            for r in regions:
                mine = [c for c in claims if c[0] == r[0]]
                if len(mine) > 2:
                    rate = lambda cs: sum(c[4] - c[3] for c in cs) / sum(c[2] for c in cs)  # noqa: E731
                    s["first_claim"].append(rate(mine[:1]) / rate(mine[2:]))

    med = lambda v: statistics.median(v) if v else float("nan")  # noqa: E731
    what = (f"W's first {args.steps} steps, {args.requests} requests added at once (prefill)" if args.prefill
            else f"{args.requests} sequences decoding, {args.steps} steps")
    print(f"{args.dtype}, {what}: {med(step_tokens):.0f} tokens a step (median), step median "
          f"{1e3 * med(step_s):.1f} ms; time-stamp counter {hz / 1e9:.3f} GHz")
    print("| GEMM | calls | µs a call | before it, µs | threads' time in claims | multiply GFLOP/s a thread "
          "| epilogue share of claims | first claim's time a row / later claims' |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in (*KINDS, "lm_head"):
        s = stats[kind]
        if not s["us"]:
            print(f"| {kind} | 0 (not Pagoda's GEMM here: oneDNN's, untraced) | | | | | | |")
            continue
        print(f"| {kind} | {len(s['us'])} | {med(s['us']):.0f} | {med(s['gap_us']):.0f} | "
              f"{100 * med(s['in_claims']):.1f}% | {med(s['gflops_thread']):.1f} | {100 * med(s['epilogue']):.1f}% | "
              f"{med(s['first_claim']):.3f} |")
    per_step = {k: med(stats[k]["us"]) * len(stats[k]["us"]) / args.steps / 1e3
                for k in (*KINDS, "lm_head") if stats[k]["us"]}
    print(f"GEMMs (medians x calls) {sum(per_step.values()):.1f} ms of a {1e3 * med(step_s):.1f} ms step: "
          + ", ".join(f"{k} {v:.1f}" for k, v in per_step.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
