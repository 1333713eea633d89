"""What the CPU attention kernels wait for: this checkout's kernel against copies of it with one part
knocked out, alternating in one process.

    python bench/kernel_knockout.py decode [--cache bf16|int8|e4m3] [--model smollm2|llama8b] [--hot]
                                           [--reps 20]
    python bench/kernel_knockout.py prefill [--calls 20]
    python bench/kernel_knockout.py decode --only qk_dots,all_dots

Each knock-out is kernels/csrc/paged_attention_cpu.cpp with a few lines replaced (KNOCKOUTS below),
built as its own extension (ops under ``torch.ops.pagoda_ko_<name>``). Its outputs are wrong by
design: only its time means anything. A knock-out's speed over the kernel's says how much of the
kernel's time that part costs where it is timed: from DRAM (decode: bench/kernel_bench.py's cases of
``--model``'s shapes, SmolLM2's by default, every call on another layer's caches, scattered blocks),
with K/V in L2 (``--hot``: SmolLM2 4 sequences of 512 tokens, Llama-8B one of 256), or on W-like
prefill steps (bench/prefill_kernel_ab.py's cases). Removing the arithmetic of a part that runs
beside the memory reads barely moves a DRAM-bound call; removing it where the core waits on it does.

Decode knock-outs (the bf16 query paths with vdpbf16ps, AVX512-BF16 builds; ``--cache`` picks the
cache's format): ``qk_dots`` the Q K^T dot products (the K rows still loaded; SmolLM2's paired
tokens and Llama-8B's one token a vector), ``pv_dots`` the P V dot products (the V rows still loaded
and interleaved), ``all_dots`` both. Prefill knock-outs (the
AMX panel, CPUs with AMX-BF16): ``exp`` the softmax's exponentials (the identity instead),
``softmax`` the whole softmax (scores rounded straight to P), ``o_update`` the O = O * alpha + P V
update, ``qk_tiles`` the Q K^T tile products (the tile loads stay), ``kv_pack`` every key tile's
packing but the first.

A replacement that no longer matches the source fails with the knock-out's name: update its lines
here when the kernel changes. bench/RESULTS.md (seventieth session) reads it.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import kernel_bench  # noqa: E402

SOURCE = ROOT / "kernels" / "csrc" / "paged_attention_cpu.cpp"

_QK_BF16 = "        for (int j = 0; j < NH; ++j) part[j] = _mm512_dpbf16_ps(part[j], qd[kh][j][c], kv);\n"
_QK_I8 = """        for (int j = 0; j < NH; ++j) {
          ph[j] = _mm512_dpbusd_epi32(ph[j], kv, qh[kh][j][c]);
          pl[j] = _mm512_dpbusd_epi32(pl[j], kv, ql[kh][j][c]);
        }
"""
_KEEP_KV = '        asm volatile("" :: "v"(kv));\n'  # the load stays, its products go
_QK_I8_ONE = """        for (int j = 0; j < NH; ++j) {
          const auto* digits = reinterpret_cast<const uint8_t*>(qf + (static_cast<size_t>(kh) * g + j) * D);
          ph[j] = _mm512_dpbusd_epi32(ph[j], kv, load(digits + c * 64));
          pl[j] = _mm512_dpbusd_epi32(pl[j], kv, load(digits + D + c * 64));
        }
"""  # (span_scores_i8dot: one token a vector, the Llama-8B shapes' path)
_QK_BF16_ONE = """          for (int j = 0; j < NH; ++j)
            part[j] = _mm512_dpbf16_ps(part[j], (__m512bh)_mm512_loadu_si512(qh + j * D + c * 32), kv);
"""
_KEEP_KV_ONE = '          asm volatile("" :: "v"(kv));\n'
_PV = """          for (int j = 0; j < NH; ++j) {
            lo[w][j] = pv_dot<F8>(lo[w][j], vlo, pw[j]);
            hi[w][j] = pv_dot<F8>(hi[w][j], vhi, pw[j]);
          }
"""
_KEEP_V = '          asm volatile("" :: "v"(vlo), "v"(vhi));\n'
_QK_TILES = ["    _tile_dpbf16ps(0, 4, 5);\n    _tile_dpbf16ps(1, 4, 6);\n",
             "    _tile_dpbf16ps(2, 4, 5);\n    _tile_dpbf16ps(3, 4, 6);\n"]
_SOFTMAX_START = """  const __m512 vscale = _mm512_set1_ps(qscale);
  __mmask16 mk[kAmxRows][4];"""
_SOFTMAX_END = """    _mm512_store_si512(p16 + r * kKeyTile + 32, (__m512i)_mm512_cvtne2ps_pbh(e[3], e[2]));
  }
"""
_SCORES_TO_P = """  (void)qscale;
  (void)lim;
  alignas(64) float alpha[kAmxRows];
  for (int r = 0; r < kAmxRows; ++r) alpha[r] = 1.f;
  uint16_t* p16 = S.p16;
  for (int r = 0; r < kAmxRows; ++r)
    for (int v = 0; v < 4; v += 2)
      _mm512_store_si512(p16 + r * kKeyTile + 16 * v,
                         (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(sc + r * kKeyTile + 16 * v + 16),
                                                      _mm512_load_ps(sc + r * kKeyTile + 16 * v)));
#if 0
"""

# name: (kernel, [(lines, replacement), ...])
KNOCKOUTS = {
    "qk_dots": ("decode", [(_QK_BF16, _KEEP_KV), (_QK_I8, _KEEP_KV), (_QK_I8_ONE, _KEEP_KV),
                           (_QK_BF16_ONE, _KEEP_KV_ONE)]),
    "pv_dots": ("decode", [(_PV, _KEEP_V)]),
    "all_dots": ("decode", [(_QK_BF16, _KEEP_KV), (_QK_I8, _KEEP_KV), (_QK_I8_ONE, _KEEP_KV),
                            (_QK_BF16_ONE, _KEEP_KV_ONE), (_PV, _KEEP_V)]),
    "exp": ("prefill", [("    row_probs(x, mk[r], mnew[r], alpha[r], S.lsum[row0 + r], e);\n",
                         "    for (int v = 0; v < 4; ++v) e[v] = _mm512_maskz_mov_ps(mk[r][v], x[v]);\n"
                         "    S.lsum[row0 + r].v = _mm512_add_ps(S.lsum[row0 + r].v, e[0]);\n")]),
    "softmax": ("prefill", [(_SOFTMAX_START, _SCORES_TO_P + _SOFTMAX_START), (_SOFTMAX_END, _SOFTMAX_END + "#endif\n")]),
    "o_update": ("prefill", [("        _mm512_storeu_ps(o + 16 * v, _mm512_fmadd_ps(_mm512_loadu_ps(o + 16 * v), a, "
                              "_mm512_load_ps(op + r * 64 + 16 * v)));",
                              "        (void)o, (void)a;")]),
    "qk_tiles": ("prefill", [(lines, "") for lines in _QK_TILES]),
    "kv_pack": ("prefill", [("      pack_kv<T>(P, rows_a[cur], rows_b[cur], nk, S);\n    } else {",
                             "      if (k0 == 0) pack_kv<T>(P, rows_a[cur], rows_b[cur], nk, S);\n    } else {")]),
}


def knocked_out(name: str) -> str:
    """The kernel's source with knock-out ``name``'s lines replaced (its ops still under pagoda_cpu)."""
    text = SOURCE.read_text()
    for old, new in KNOCKOUTS[name][1]:
        if text.count(old) != 1:
            raise SystemExit(f"knock-out {name!r}: its lines are not (once) in {SOURCE.name} any more; update "
                             f"KNOCKOUTS in {Path(__file__).name}:\n{old}")
        text = text.replace(old, new)
    return text


def build(name: str):
    return kernel_bench.load_cpu_sources({"knockout.cpp": knocked_out(name)}, f"pagoda_ko_{name}")


def decode(args, ops) -> None:
    from pagoda_kernels.attention import quantize_int8_rows
    from pagoda_kernels.cpu_attention import paged_decode_attention

    kernel_bench.MIN_CACHE_BYTES = 0 if args.hot else args.cache_mb << 20
    cases = [c for c in (kernel_bench.HOT_CASES if args.hot else kernel_bench.CASES) if c[0] == args.model]
    convert = {"bf16": None, "int8": quantize_int8_rows, "e4m3": lambda t: t.to(torch.float8_e4m3fn)}[args.cache]
    nt = torch.get_num_threads()
    print(f"decode, bf16 queries, {args.cache} cache, {nt} threads, {'K/V in L2' if args.hot else 'from DRAM'}, "
          f"median of {args.reps}; speed of each knock-out over the kernel's\n")
    print("| case | kernel ms | " + " | ".join(ops) + " |")
    print("|---" * (len(ops) + 2) + "|")
    for label, h, kvh, d, batch, ctx in cases:
        q, caches, meta, _ = kernel_bench.make_case(h, kvh, d, batch, ctx, torch.bfloat16)
        if convert is not None:
            caches = [(convert(k), convert(v)) for k, v in caches]
        bt, sl, scale = meta.decode_block_tables, meta.decode_seq_lens, 1 / math.sqrt(d)
        out = torch.empty_like(q)
        paged_decode_attention(q, *caches[0], bt, sl, scale, out=out)  # builds and loads the extension
        fns = [lambda k, v, op=op: op.paged_decode_attention(q, k, v, bt, sl, scale, out, nt)
               for op in [torch.ops.pagoda_cpu, *ops.values()]]
        t, *ko = kernel_bench.time_interleaved(fns, caches, args.reps)
        print(f"| {label} {batch} x {ctx} | {t * 1e3:.3f} | " + " | ".join(f"{t / x:.3f}x" for x in ko) + " |",
              flush=True)
        del caches


def prefill(args, ops) -> None:
    from prefill_kernel_ab import CASES, make_case

    nt = torch.get_num_threads()
    print(f"prefill, bf16, {nt} threads, {args.calls} calls each, in turn; speed of each knock-out over the "
          f"kernel's\n")
    print("| chunks | kernel ms | " + " | ".join(ops) + " |")
    print("|---" * (len(ops) + 2) + "|")
    for name, chunks in CASES.items():
        inputs, _ = make_case(chunks, torch.bfloat16)
        all_ops = [torch.ops.pagoda_cpu.paged_prefill_attention] + [op.paged_prefill_attention for op in ops.values()]
        out = torch.empty_like(inputs[0])
        for op in all_ops * 2:
            op(*inputs, 0.125, out, nt)
        spent = [0.0] * len(all_ops)
        for i in range(args.calls):
            for j in range(len(all_ops)):
                k = (i + j) % len(all_ops)
                t0 = time.perf_counter()
                all_ops[k](*inputs, 0.125, out, nt)
                spent[k] += time.perf_counter() - t0
        print(f"| {name} | {spent[0] / args.calls * 1e3:.3f} | " + " | ".join(f"{spent[0] / s:.3f}x" for s in spent[1:])
              + " |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", choices=["decode", "prefill"])
    ap.add_argument("--only", default=None, help="comma-separated knock-outs (default: every one of the kernel's)")
    ap.add_argument("--cache", default="bf16", choices=["bf16", "int8", "e4m3"], help="decode: the K/V cache's format")
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "llama8b"],
                    help="decode: the shapes (kernel_bench.CASES of that model)")
    ap.add_argument("--hot", action="store_true",
                    help="decode: K/V in L2 (SmolLM2 4 x 512 tokens, Llama-8B 1 x 256), one thread unless --threads")
    ap.add_argument("--reps", type=int, default=20, help="decode: timed calls of each kernel per case")
    ap.add_argument("--cache-mb", type=int, default=512, help="decode: bf16 K/V cycled through per case")
    ap.add_argument("--calls", type=int, default=20, help="prefill: timed calls of each kernel per case")
    ap.add_argument("--threads", type=int, default=0, help="torch / OpenMP threads (default: torch's)")
    args = ap.parse_args()
    if min(args.reps, args.calls, args.cache_mb) < 1 or args.threads < 0:
        ap.error("--reps, --calls and --cache-mb must be >= 1, --threads >= 0")
    names = [n for n, (k, _) in KNOCKOUTS.items() if k == args.kernel]
    if args.only:
        names = args.only.split(",")
        wrong = [n for n in names if KNOCKOUTS.get(n, ("",))[0] != args.kernel]
        if wrong:
            ap.error(f"not {args.kernel} knock-outs: {', '.join(wrong)} (those: "
                     f"{', '.join(n for n, (k, _) in KNOCKOUTS.items() if k == args.kernel)})")
    if args.threads or (args.hot and args.kernel == "decode"):
        torch.set_num_threads(args.threads or 1)
    from pagoda_kernels.cpu_attention import decode_supports_int8, load_extension

    load_extension()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if args.kernel == "decode" and (os.environ.get("PAGODA_CPU_MARCH") or " avx512_bf16" not in flags):
        print("the decode knock-outs are in the vdpbf16ps paths, which this build has not (a CPU with "
              "AVX512-BF16, no PAGODA_CPU_MARCH): nothing to knock out")
        return 1
    if args.kernel == "decode" and args.cache == "int8" and not decode_supports_int8(torch.bfloat16):
        print("this build's decode kernel reads no int8 cache with bf16 queries")
        return 1
    if args.kernel == "prefill" and not torch.ops.pagoda_cpu.set_prefill_amx(True):
        print("no AMX prefill panel on this CPU: nothing to knock out")
        return 1
    ops = {name: build(name) for name in names}
    (decode if args.kernel == "decode" else prefill)(args, ops)
    return 0


if __name__ == "__main__":
    sys.exit(main())
