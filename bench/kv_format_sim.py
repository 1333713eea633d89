"""Candidate one-byte K/V formats, simulated in the engine before any kernel is written for them:
how far each would move outputs from the model dtype's cache (bench/kv_fp8_agreement.py's two
measures, same prompts).

    python bench/kv_format_sim.py [--dtype bfloat16|float32] [--formats e4m3+flush,e4m3-token,...]

The engine keeps its model-dtype cache and runs its layers from Python (no one-call layer stack),
with its three K/V writers (``write_kv``, ``rotary_qkv_to_cache`` and the QKV GEMM's rotary
epilogue) wrapped: after each writes a step's new slots, those slots are rounded in place through
the format (quantized, then dequantized into the cache's dtype) before the step's attention reads
them. Every K/V value attention sees is then what the format would hold.

Formats (a scale per row = per token and kv head, over head_dim values):
  e5m2, e4m3           the codes of ``kv_cache_dtype`` "fp8_e5m2" / "fp8" (scale 1; e4m3 saturates
                       at +-448 first, as Pagoda's writers do)
  e4m3-pow2            a power-of-two scale a row: the smallest 2^k with the row's largest
                       magnitude / 2^k <= 448
  e4m3-token           a float32 scale a row: largest magnitude / 448 (that value exact)
  int8-token           int8 codes, a float32 scale a row: largest magnitude / 127, round half even
  int7-token           the same with codes -63 .. 63 (largest magnitude / 63)
  +flush               after any of them: codes below 2^-6 (e4m3) or 2^-14 (e5m2) in magnitude
                       read as zero, as the bf16 decode kernel with vdpbf16ps reads them
  K/V                  K through format K, V through format V ("none": as the model dtype's cache)
  ...+q8               (a whole entry's suffix) the queries too: each query head's head_dim values as
                       int8 codes with a float32 scale (largest magnitude / 127), as a kernel taking
                       Q K^T in int8 dot products (vpdpbusd) would read them; in decode, and in the
                       teacher-forced measure's prompt steps (each position there stands for the
                       decode step that would have produced it)

With a bf16 model the dequantized values are rounded to bf16 again to sit in the cache (a kernel
would apply a float32 scale in float32 instead); e5m2+flush and e4m3+flush are what Pagoda's
one-byte caches give with bf16 queries on AVX512-BF16 builds, and their figures agree with
``bench/kv_fp8_agreement.py --text``'s for those caches (the check that the simulation models
the kernels).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kv_fp8_agreement import report, teacher_forced, text_prompts  # noqa: E402

FORMATS = ("e5m2", "e4m3", "e4m3-pow2", "e4m3-token", "int8-token", "int7-token")
E4M3_MAX = 448.0


def round_through(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Rows x [..., head_dim] as the format ``fmt`` (a FORMATS name, optionally + "+flush") holds
    them, back in x's dtype."""
    name, flush = fmt.removesuffix("+flush"), fmt.endswith("+flush")
    if name == "none":
        return x
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    one = torch.ones_like(amax)
    if name == "e5m2":
        scale, codes = one, xf.to(torch.float8_e5m2).float()
        tiny = 2.0 ** -14
    elif name in ("int8-token", "int7-token"):
        top = 127.0 if name == "int8-token" else 63.0
        scale = torch.where(amax > 0, amax / top, one)
        codes, tiny = torch.round(xf / scale).clamp(-top, top), 0.0
    else:
        if name == "e4m3":
            scale = one
        elif name == "e4m3-pow2":
            scale = torch.exp2(torch.ceil(torch.log2(torch.where(amax > 0, amax, one) / E4M3_MAX)))
        elif name == "e4m3-token":
            scale = torch.where(amax > 0, amax / E4M3_MAX, one)
        else:
            raise ValueError(f"unknown format {fmt!r}; formats: {FORMATS}, each optionally with +flush")
        codes = (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
        tiny = 2.0 ** -6
    if flush:
        codes = torch.where(codes.abs() < tiny, torch.zeros_like(codes), codes)
    return (codes * scale).to(x.dtype)


def kv_formats(fmt: str) -> tuple[str, str]:
    """A --formats entry as (K's format, V's format)."""
    k, _, v = fmt.removesuffix("+q8").partition("/")
    return k, v or k


def round_queries(q: torch.Tensor) -> torch.Tensor:
    """Queries [..., head_dim] as int8 codes with a float32 scale a head hold them, back in q's dtype."""
    return round_through(q, "int8-token")


QUERIES = {"prefill": False}  # whether prefill steps round their queries too (the teacher-forced measure)


def simulate(fmt: str | None) -> None:
    """Has the engine's K/V writers round what they write through ``fmt`` (None: leave it), and with
    "+q8" decode attention (prefill too while QUERIES["prefill"]) its queries."""
    import pagoda_kernels.cpu_attention as cpu_attention
    import pagoda_kernels.layer_ops as layer_ops
    from engine_service.models import llama

    llama.LlamaForCausalLM.build_layer_stack = lambda self, ops: False  # the layers from Python

    def wrap(cls, name):
        original = getattr(cls, f"_sim_{name}", None) or getattr(cls, name)
        setattr(cls, f"_sim_{name}", original)

        def write(self, *args):
            out = original(self, *args)
            key_cache, value_cache, slot_mapping = args[-3:]
            if fmt is not None:
                for cache, f in zip((key_cache, value_cache), kv_formats(fmt)):
                    flat = cache.view(-1, *cache.shape[2:])
                    flat[slot_mapping] = round_through(flat[slot_mapping], f)
            return out
        setattr(cls, name, write)

    wrap(cpu_attention.CpuAttention, "write_kv")
    q8 = fmt is not None and fmt.endswith("+q8")
    for name in ("decode", "prefill"):
        original = getattr(cpu_attention.CpuAttention, f"_sim_{name}", None) or getattr(cpu_attention.CpuAttention, name)
        setattr(cpu_attention.CpuAttention, f"_sim_{name}", original)

        def attend(self, q, *args, _original=original, _name=name, **kwargs):
            if q8 and (_name == "decode" or QUERIES["prefill"]):
                q = round_queries(q)
            return _original(self, q, *args, **kwargs)
        setattr(cpu_attention.CpuAttention, name, attend)
    wrap(layer_ops.CpuLayerOps, "rotary_qkv_to_cache")
    wrap(layer_ops.CpuLayerOps, "gemm_linear_rotary_qkv_to_cache")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--formats", default="e5m2+flush,e4m3+flush,e4m3,e4m3-pow2+flush,e4m3-token+flush,int8-token",
                    help="comma-separated: " + ", ".join(FORMATS) + ", each optionally with +flush; K/V for "
                         "one format for K and another for V (none: the model dtype)")
    args = ap.parse_args()
    formats = args.formats.split(",")
    probe = torch.randn(4, 64)
    for fmt in formats:  # unknown names fail here, before any engine starts
        for f in kv_formats(fmt):
            round_through(probe, f)
    from engine_service import LLM, SamplingParams

    prompts = text_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outputs, forced, prompt_ids = {}, {}, None
    for fmt in [None] + formats:
        simulate(fmt)
        llm = LLM(dtype=args.dtype)
        results = llm.generate(prompts, params, use_tqdm=False)
        outputs[fmt] = [list(o.outputs[0].token_ids) for o in results]
        if prompt_ids is None:
            prompt_ids = [list(o.prompt_token_ids) for o in results]
        QUERIES["prefill"] = True
        forced[fmt] = teacher_forced(llm, SamplingParams, prompt_ids, outputs[None])
        QUERIES["prefill"] = False
        del llm
        if fmt is not None:
            report(f"simulated {fmt}, 32 English instructions, {args.dtype}", outputs[None], outputs[fmt],
                   forced[None], forced[fmt])
    return 0


if __name__ == "__main__":
    sys.exit(main())
