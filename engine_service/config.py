"""Engine configuration: one validated object, vLLM's option names."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# vLLM's names: "fp8" is e4m3 (as on vLLM's GPUs, with its default scale of 1.0).
_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
                    "int8": torch.int8}
KV_CACHE_DTYPE_CHOICES = ["auto", *_KV_CACHE_DTYPES]
# The CPU KV budget where kv_cache_memory_bytes is not given (the library, the batch job and serve
# alike): this variable, else 4 GiB, as vLLM-CPU's VLLM_CPU_KVCACHE_SPACE (which counts GiB).
KV_BUDGET_ENV = "PAGODA_KV_CACHE_MEMORY_BYTES"
DEFAULT_CPU_KV_BUDGET = 4 << 30


def parse_bytes(text: str) -> int:
    """``4294967296``, ``4GiB``, ``512MiB``, ``1.5G`` -> bytes; ValueError otherwise."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"not a byte size: {text!r} (e.g. 4294967296, 512MiB, 4GiB)")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))


def default_cpu_kv_budget() -> tuple[int, str]:
    """``$PAGODA_KV_CACHE_MEMORY_BYTES`` where set (e.g. ``512MiB``), else 4 GiB; and the variable's
    text ('' where unset), for errors to name."""
    text = os.environ.get(KV_BUDGET_ENV, "").strip()
    if not text:
        return DEFAULT_CPU_KV_BUDGET, text
    try:
        budget = parse_bytes(text)
    except ValueError as e:
        raise ValueError(f"{KV_BUDGET_ENV}={text!r}: {e}") from None
    if budget <= 0:
        raise ValueError(f"{KV_BUDGET_ENV} must be > 0 bytes, got {text!r}")
    return budget, text


def cpu_has_bf16_dot() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512_BF16 or AMX); without, torch's bf16 GEMM
    converts in its inner loop and runs ~3x slower than float32 (measured: 44 vs 150 GFLOP/s on a
    2-core AVX-512 Xeon without AVX512_BF16). Not where torch's kernels are held below AVX-512
    (ATEN_CPU_CAPABILITY=avx2 or default, as when testing another CPU's paths: kernels/README.md)."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


@dataclass
class EngineConfig:
    """Options of one engine, with vLLM's names and meanings.

    ``__post_init__`` checks ranges; ``finalize`` clamps the limits that depend on the model
    (``max_model_len`` to its positions, the KV block count from the byte budget) so that nothing
    downstream re-validates.
    """

    model: str | None = None  # None / "bundled", a HF directory or a .gguf file
    dtype: str = "bfloat16"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    # Tokens per KV block; None: 64 on CPU (as vLLM's CPU backend, which takes 128), 16 elsewhere.
    # On CPU the decode kernel reads each sequence's blocks from scattered addresses, and longer
    # contiguous runs stream better: on the shared bf16 workload (Zen 4) decode attention took
    # 10.9 s at 64 against 11.9 s at 16, the KV writes 0.3 s against 1.0 s (bench/RESULTS.md).
    block_size: int | None = None
    # CPU KV budget in bytes (vLLM-CPU's VLLM_CPU_KVCACHE_SPACE); None: $PAGODA_KV_CACHE_MEMORY_BYTES,
    # else 4 GiB. GPUs use gpu_memory_utilization.
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap": KV copied to host memory and back
    swap_space_bytes: int = 1 << 30
    seed: int = 0
    device: str = "cpu"
    attention_backend: str = "auto"  # "cpu" | "torch" | "triton" | "auto"
    enforce_eager: bool = True
    max_logprobs: int = 20  # most logprobs a request may ask for per token, as in vLLM
    # dtype of the linear layers' GEMMs: "auto" = the model dtype, except that a bfloat16 model on a
    # CPU without bf16 dot-product instructions (AVX512_BF16 / AMX) multiplies in float32 on its
    # bf16 weights (exact widening), which is that hardware's fastest way to do bf16 arithmetic.
    matmul_dtype: str = "auto"
    # CPU: write the whole KV cache once at start-up (vLLM's CPU backend allocates it with
    # torch.zeros), so that generation never page-faults it in 4 KiB at a time: on the shared bf16
    # workload the first-touch faults cost ~4 s of a 54 s run (bench/RESULTS.md). Costs ~1 s per GiB
    # of KV budget at start-up and commits that memory at once.
    kv_cache_prefault: bool = True
    # dtype of the paged KV cache, vLLM's kv_cache_dtype: "auto" = the model dtype; one byte a
    # value: "fp8" or "fp8_e4m3" (float8_e4m3fn: 4 exponent bits, 3 mantissa bits, values up to
    # +-448, larger ones saturating there, scale 1.0 as vLLM's default) or "fp8_e5m2" (5 exponent
    # bits, 2 mantissa bits), values as torch's conversion rounds them: half the bytes a decode
    # step's attention reads (a quarter for a float32 model) and twice the tokens a KV budget
    # holds. e4m3's extra mantissa bit cuts e5m2's error in the next token's log-probability by 40%
    # (0.073 against 0.120 on SmolLM2 in bf16, bench/kv_fp8_agreement.py). Output is then no longer
    # token-identical to transformers (the kernels give what a bf16 cache of the codes' values
    # gives) and drifts: bench/kv_fp8_agreement.py, bench/RESULTS.md; a request preempted and
    # recomputed (preemption_mode "recompute") may continue differently, where a recomputed K/V
    # value rounds to another code ("swap" keeps the codes). A bfloat16 model on a CPU with
    # AVX512-BF16 (bf16 dot products, subnormal codes read as zero) or with AVX2 and no AVX-512, a
    # float32 model on a CPU with AVX-512 or AVX2 (the codes widened exactly to float32): where
    # Pagoda's C++ kernels read it. "int8": each (token, kv head) row as int8 codes and a float32
    # scale (its largest magnitude / 127; 68 bytes a row of 64, 53% of bf16's), half e4m3's error
    # again (0.036, bench/kv_format_sim.py) at a slower decode read than fp8's (the codes converted
    # to bf16 through float32); where the fp8 caches are read.
    kv_cache_dtype: str = "auto"
    # CPU with AVX512-BF16 or AMX-BF16, bf16 model: the decoder layers' GEMMs on Pagoda's own
    # kernels (kernels/csrc/cpu_ops.cpp: AMX tiles through torch's brgemm micro-kernel, else
    # AVX512-BF16 dot products), with silu * up and rotary + K/V cache write fused into the gate/up
    # and QKV GEMMs; with AMX, plain GEMMs of over 1024 rows stay on oneDNN (faster there). A row's
    # GEMM output then no longer depends on the step's row count. Ignored on other CPUs.
    cpu_bf16_gemm: bool = True
    # Decoder-layer GEMMs on float32 weights (a float32 model's, or a bf16 model's where matmul_dtype
    # is float32: bf16 activations widened, outputs rounded to bf16) on Pagoda's own FMA kernel
    # (AVX-512 or AVX2), with the same fusions (silu * up, rotary + K/V write) and the same row-count
    # invariance as above. None or True: wherever the CPU has AVX2 and FMA (faster than oneDNN's on
    # W: +3% on Zen 3, +7% on Zen 4, +4% on the AMX Xeon, bench/RESULTS.md); False: never
    # (oneDNN's packed GEMM).
    cpu_f32_gemm: bool | None = None
    # Speculative decoding by prompt lookup (vLLM's "ngram" method): a greedy request's next
    # tokens are guessed by finding its last prompt_lookup_max .. prompt_lookup_min tokens earlier
    # in its own prompt + output and proposing up to num_speculative_tokens tokens that followed;
    # one forward pass verifies them, and the longest prefix the model agrees with is kept (greedy
    # output is unchanged). 0 turns it off. It pays where outputs copy from their context (and in
    # small batches, where a step is bound by reading weights and KV); in a large compute-bound
    # batch every rejected guess costs a token's arithmetic.
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    # The same in vLLM's form: {"method": "ngram", "num_speculative_tokens": 4,
    # "prompt_lookup_max": 3, "prompt_lookup_min": 1}; sets the three fields above.
    speculative_config: dict | None = None

    # Derived by finalize().
    num_kv_blocks: int = 0
    num_swap_blocks: int = 0

    def __post_init__(self) -> None:
        if self.block_size is None:
            self.block_size = 64 if self.device == "cpu" else 16
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        for name in ("max_num_seqs", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.matmul_dtype != "auto" and self.matmul_dtype not in _DTYPES:
            raise ValueError(f"matmul_dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.matmul_dtype!r}")
        if self.cpu_f32_gemm is not None and not isinstance(self.cpu_f32_gemm, bool):  # "no" would read as True
            raise ValueError(f"cpu_f32_gemm must be None (the CPU decides), True or False, got {self.cpu_f32_gemm!r}")
        if self.speculative_config is not None:
            self._apply_speculative_config(dict(self.speculative_config))
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be 'auto' (the model dtype) or one of {list(_KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and (self.device != "cpu" or self.dtype not in ("bfloat16", "float32")):
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} needs device 'cpu' and dtype 'bfloat16' or "
                             f"'float32' (Pagoda's CPU kernels read it), got device {self.device!r} and dtype "
                             f"{self.dtype!r}")
        if self.attention_backend not in ("cpu", "torch", "triton", "auto"):
            raise ValueError(f"attention_backend must be 'cpu', 'torch', 'triton' or 'auto', "
                             f"got {self.attention_backend!r}")

    def _apply_speculative_config(self, spec: dict) -> None:
        method = spec.pop("method", None)
        if method != "ngram":
            raise ValueError(f"speculative_config.method must be 'ngram' (prompt lookup, the only method "
                             f"Pagoda has), got {method!r}")
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            if key in spec:
                value = spec.pop(key)
                if not isinstance(value, int) or isinstance(value, bool):
                    raise ValueError(f"speculative_config.{key} must be an integer, got {value!r}")
                setattr(self, key, value)
        if spec:
            raise ValueError(f"speculative_config: unknown keys {sorted(spec)}; known: method, "
                             f"num_speculative_tokens, prompt_lookup_max, prompt_lookup_min")
        if "num_speculative_tokens" not in self.speculative_config:
            raise ValueError("speculative_config.num_speculative_tokens is required")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def torch_kv_cache_dtype(self) -> torch.dtype:
        return self.torch_dtype if self.kv_cache_dtype == "auto" else _KV_CACHE_DTYPES[self.kv_cache_dtype]

    @property
    def torch_matmul_dtype(self) -> torch.dtype:
        if self.matmul_dtype != "auto":
            return _DTYPES[self.matmul_dtype]
        if self.dtype == "bfloat16" and self.device == "cpu" and not cpu_has_bf16_dot():
            return torch.float32
        return self.torch_dtype

    def finalize(self, max_position_embeddings: int, kv_bytes_per_block: int) -> None:
        """Clamp model-dependent limits and size the KV pool; raise if one sequence cannot fit."""
        if self.max_model_len is None:
            self.max_model_len = max_position_embeddings
        elif self.max_model_len > max_position_embeddings:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({max_position_embeddings})"
            )
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = (
                max(2048, self.max_num_seqs) if self.enable_chunked_prefill
                else max(self.max_model_len, self.max_num_seqs)
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when enable_chunked_prefill is False"
            )
        from_env = ""  # the budget's $PAGODA_KV_CACHE_MEMORY_BYTES, where it came from there
        if self.num_gpu_blocks_override is not None:
            self.num_kv_blocks = self.num_gpu_blocks_override
        else:
            budget = self.kv_cache_memory_bytes
            if budget is None and self.device == "cpu":
                budget, from_env = default_cpu_kv_budget()
            elif budget is None:
                budget = self._gpu_kv_budget()
            self.num_kv_blocks = budget // kv_bytes_per_block
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        if self.num_kv_blocks < blocks_per_seq:
            raise ValueError(
                f"KV cache too small: {self.num_kv_blocks} blocks of {self.block_size} tokens hold fewer "
                f"than one max_model_len={self.max_model_len} sequence, which needs {blocks_per_seq} "
                f"blocks = {blocks_per_seq * kv_bytes_per_block} bytes; raise kv_cache_memory_bytes"
                f"{f' ({KV_BUDGET_ENV}={from_env} here)' if from_env else ''} or lower max_model_len"
            )
        self.num_swap_blocks = self.swap_space_bytes // kv_bytes_per_block if self.preemption_mode == "swap" else 0

    def _gpu_kv_budget(self) -> int:
        free, total = torch.cuda.mem_get_info()
        used = total - free
        return max(0, int(total * self.gpu_memory_utilization) - used)
