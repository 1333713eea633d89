"""Would two micro-batches per step pay here: one core's decode attention (memory-bound) beside
the other core's GEMMs (compute-bound), instead of both cores on each in turn?

    python bench/overlap_probe.py

One process, SmolLM2 shapes in bf16, 256 sequences x 448 tokens, 8 layers' caches cycled (DRAM).
serial: per layer the C++ decode attention on all 256 sequences (2 threads), then the layer's four
GEMM shapes on 256 rows (2 threads). overlapped: per layer, twice: attention on half the sequences
(1 thread) while a Python thread runs the GEMMs of the other half's 128 rows (torch on 1 thread).
Prints the median of 6 rounds of each and their ratio (> 1: overlapping pays), then the serial
round's split. bench/RESULTS.md (thirteenth session) reads it.
"""
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from decode_fixture import HEAD_DIM, HEADS, decode_inputs, linear, packed_weight  # noqa: E402

B, CTX, LAYERS = 256, 448, 8


def main() -> int:
    import torch

    from pagoda_kernels.cpu_attention import paged_decode_attention

    torch.manual_seed(0)
    caches, tables, lens, q = decode_inputs(B, CTX, LAYERS)
    # o_proj, gate/up, down, qkv of each layer
    shapes = [(576, 576), (3072, 576), (576, 1536), (960, 576)]
    weights = [[packed_weight(n, k) for n, k in shapes] for _ in range(LAYERS)]

    def gemms(layer, rows):
        wo, wgu, wd, wqkv = weights[layer]
        y = linear(torch.randn(rows, 576).bfloat16(), wo)
        gate_up = linear(y, wgu)
        linear(linear(gate_up[:, :1536].contiguous(), wd), wqkv)

    def attention(layer, rows: slice, threads):
        kc, vc = caches[layer]
        out = torch.empty(rows.stop - rows.start, HEADS, HEAD_DIM, dtype=torch.bfloat16)
        torch.ops.pagoda_cpu.paged_decode_attention(q[rows].contiguous(), kc, vc, tables[rows].contiguous(),
                                                    lens[rows].contiguous(), 0.125, out, threads)

    paged_decode_attention(q[:1], caches[0][0], caches[0][1], tables[:1], lens[:1], 0.125)  # builds the extension

    def serial():
        torch.set_num_threads(2)
        t = time.perf_counter()
        for layer in range(LAYERS):
            attention(layer, slice(0, B), 2)
            gemms(layer, B)
        return time.perf_counter() - t

    def overlapped():
        torch.set_num_threads(1)
        t = time.perf_counter()
        for layer in range(LAYERS):
            for half in (slice(0, B // 2), slice(B // 2, B)):
                other = threading.Thread(target=gemms, args=(layer, B // 2))
                other.start()
                attention(layer, half, 1)
                other.join()
        return time.perf_counter() - t

    serial(), overlapped()  # warm-up
    s, o = [], []
    for _ in range(6):
        s.append(serial())
        o.append(overlapped())
    ms, mo = statistics.median(s), statistics.median(o)
    print(f"per {LAYERS} layers: serial {ms * 1e3:.1f} ms, overlapped {mo * 1e3:.1f} ms: {ms / mo:.3f}x")
    torch.set_num_threads(2)
    ta = tg = 0.0
    for layer in range(LAYERS):
        t = time.perf_counter()
        attention(layer, slice(0, B), 2)
        ta += time.perf_counter() - t
        t = time.perf_counter()
        gemms(layer, B)
        tg += time.perf_counter() - t
    print(f"serial split: attention {ta * 1e3:.1f} ms, GEMMs {tg * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
