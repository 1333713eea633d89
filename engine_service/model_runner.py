"""Model runner: turns a ``SchedulerOutput`` into one forward pass and samples the next tokens.

Per step it builds the flattened batch (token ids, positions, slot mapping, block tables) with
vectorised ops, applies the step's KV block copies and swaps, runs the model once, computes
logits only for the sequences that complete their pending tokens, and samples them.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine_service import cpu_malloc
from engine_service.config import EngineConfig
from engine_service.models.llama import KeptRows, LlamaForCausalLM
from engine_service.sampler import Sampler, SamplerOutput, SamplingBatch
from engine_service.scheduler import SchedulerOutput
from engine_service.sequence import Request, Sequence
from pagoda_kernels.attention import AttentionMetadata, cache_row_elems, get_attention_backend
from pagoda_kernels.layer_ops import get_layer_ops

logger = logging.getLogger(__name__)


# Rows of prompt-logprob logits at a time: [512, vocab] float32 is ~100 MB for the bundled model's
# 49152 tokens, where a 2048-token chunk's at once would be 400 MB.
PROMPT_LOGPROBS_ROWS = 512


@dataclass
class PromptLogprobs:
    """One prefill chunk's prompt logprobs for a request that asked for them: entries ``first`` ..
    ``first + len(logprobs) - 1`` of its ``prompt_logprobs`` (entry j: prompt token j, scored by the
    logits of position j - 1). Per entry: the token's logprob and rank, the top K ids and logprobs
    (K the batch's largest ask)."""

    request: Request
    first: int
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def kv_bytes_per_block(model_config, config: EngineConfig) -> int:
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    elem = torch.empty((), dtype=config.torch_kv_cache_dtype).element_size()
    return 2 * model_config.num_hidden_layers * config.block_size * model_config.num_key_value_heads * elem * (
        cache_row_elems(head_dim, config.torch_kv_cache_dtype))


class ModelRunner:
    """Owns the model, the paged KV cache, the attention backend and the sampler."""

    def __init__(self, config: EngineConfig, model_config, weights, eos_token_ids: set[int]):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        torch.manual_seed(config.seed)
        if self.device.type == "cpu":
            cpu_malloc.tune_for_engine()
        t0 = time.perf_counter()
        with torch.device(self.device):
            self.model = LlamaForCausalLM(model_config, config.max_model_len)
        self.model.load_weights(weights)
        self.model.to(self.dtype)
        self.matmul_dtype = config.torch_matmul_dtype
        self.model.rope_cos, self.model.rope_sin = self.model.rope_cos.float(), self.model.rope_sin.float()
        self.model.eval().requires_grad_(False)
        self.layer_ops = get_layer_ops(self.device, config.attention_backend)
        # CPU GEMMs on weights blocked once for oneDNN (see pack_cpu_weight), and the layers' GEMMs on
        # Pagoda's own kernels: bf16 with AVX512-BF16 or AMX (EngineConfig.cpu_bf16_gemm), float32 with
        # AVX-512 or AVX2 FMAs (EngineConfig.cpu_f32_gemm).
        cpu = self.device.type == "cpu"
        self.bf16_gemm = (cpu and config.cpu_bf16_gemm and self.layer_ops.bf16_gemm
                          and self.dtype == torch.bfloat16 and self.matmul_dtype == torch.bfloat16)
        f32_wanted = self.layer_ops.f32_gemm_preferred if config.cpu_f32_gemm is None else config.cpu_f32_gemm
        # float32 weights: a float32 model's, or a bf16 model's on a CPU without bf16 dot products
        # (bf16 activations widened, outputs rounded to bf16, as llama.py's linear() does).
        self.f32_gemm = (cpu and f32_wanted and self.layer_ops.f32_gemm
                         and self.dtype in (torch.float32, torch.bfloat16) and self.matmul_dtype == torch.float32)
        gemm_ops = self.layer_ops if self.bf16_gemm or self.f32_gemm else None
        if self.f32_gemm and self.dtype == torch.bfloat16:
            # A bf16 model's layers and LM head keep their bf16 weights for the float32 kernel (half
            # the memory of float32 copies, the same bits); what it does not take is widened below.
            self.model.pack_gemm_weights(gemm_ops, float32_kernel=True)
            gemm_ops = None
        if self.matmul_dtype != self.dtype:
            self.model.set_matmul_dtype(self.matmul_dtype)
        self.packed_weights = cpu and self.model.pack_weights(config.max_num_seqs, gemm_ops=gemm_ops)
        # The decoder layers in one C++ call a step where the layers allow (LlamaForCausalLM.build_layer_stack).
        if cpu and self.packed_weights:
            self.model.build_layer_stack(self.layer_ops)
        logger.info("model loaded in %.2f s%s%s", time.perf_counter() - t0,
                    " (GEMM weights packed for oneDNN)" if self.packed_weights else "",
                    " (decoder layers for Pagoda's GEMMs)" if self.bf16_gemm or self.f32_gemm else "")
        self.vocab_size = model_config.vocab_size
        self.attn = get_attention_backend(config.attention_backend, self.device)
        head_dim = self.model.layers[0].self_attn.head_dim
        self.kv_cache_dtype = config.torch_kv_cache_dtype
        shape = (model_config.num_hidden_layers, 2, config.num_kv_blocks, config.block_size,
                 model_config.num_key_value_heads, cache_row_elems(head_dim, self.kv_cache_dtype))
        if self.kv_cache_dtype != self.dtype and not (self.attn.reads_cache_dtype(self.kv_cache_dtype, self.dtype)
                                                      and self.layer_ops.reads_one_byte_cache):
            raise ValueError(f"kv_cache_dtype {config.kv_cache_dtype!r} needs Pagoda's C++ attention and layer "
                             f"kernels: a bfloat16 model on a CPU with AVX512-BF16 or AVX2, a float32 model on one "
                             f"with AVX-512 or AVX2 (here: attention backend {self.attn.name!r}, "
                             f"layer ops {type(self.layer_ops).__name__})")
        # torch.empty: pages are committed on first write (unless kv_cache_prefault writes them all now).
        self.kv_cache = torch.empty(shape, dtype=self.kv_cache_dtype, device=self.device)
        self.kv_cache_huge_pages = False
        if self.device.type == "cpu" and config.kv_cache_prefault:
            # Huge pages where the kernel has them (faulted in here, 2 MiB at a time), then every page
            # faulted in now, not one by one in the steps that first write it.
            self.kv_cache_huge_pages = cpu_malloc.advise_huge_pages(self.kv_cache)
            self.kv_cache.zero_()
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(shape[0])]
        self.swap_cache = (torch.empty((*shape[:2], config.num_swap_blocks, *shape[3:]), dtype=self.kv_cache_dtype)
                           if config.num_swap_blocks else None)
        self.sampler = Sampler(self.vocab_size, eos_token_ids, argmax=self.layer_ops.argmax,
                               sample=self.layer_ops.sample, logprobs=self.layer_ops.logprobs)
        # The last layer runs its attention, o_proj and MLP only on the rows that are sampled
        # (``LlamaForCausalLM.forward``'s keep): same values, less work in prefill steps. Only where
        # the backend's prefill gives a row the same bits whatever its chunk's other rows
        # (``prefill_rows_independent``).
        self.prune_last_layer = True

    # ---- block movement -----------------------------------------------------------------------

    def _move_blocks(self, out: SchedulerOutput) -> None:
        if out.blocks_to_swap_out:
            dev, host = (torch.tensor(x) for x in zip(*out.blocks_to_swap_out))
            self.swap_cache[:, :, host] = self.kv_cache[:, :, dev].to(self.swap_cache.device)
        if out.blocks_to_swap_in:
            host, dev = (torch.tensor(x) for x in zip(*out.blocks_to_swap_in))
            self.kv_cache[:, :, dev] = self.swap_cache[:, :, host].to(self.device)
        if out.blocks_to_copy:
            src, dst = (torch.tensor(x) for x in zip(*out.blocks_to_copy))
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    # ---- the step -----------------------------------------------------------------------------

    def _kept_rows(self, rows: torch.Tensor, meta: AttentionMetadata, seq_idx: torch.Tensor,
                   t: int, num_decodes: int) -> tuple[KeptRows | None, torch.Tensor]:
        """The last layer's rows (``KeptRows``): the decode rows and the sampled ``rows``, and the
        sampled rows' positions among them; (None, ``rows``) when that is every row (nothing to
        save). A prefill chunk's sampled row is its last, so the kept ones form chunks of their
        own with the same sequence lengths: the attention sees the same keys. ``num_decodes``: the
        sequences of the decode rows (a speculative decode has several)."""
        rd, bd = meta.num_decode_tokens, num_decodes
        kept = torch.zeros(t, dtype=torch.bool)
        kept[:rd] = True
        kept[rows] = True
        kept_rows = kept.nonzero().squeeze(1)
        if kept_rows.shape[0] == t:
            return None, rows
        counts = torch.bincount(seq_idx[kept_rows], minlength=bd + meta.num_prefills)[bd:]
        sel = counts.nonzero().squeeze(1)
        qlens = counts[sel]
        seq_lens = meta.prefill_seq_lens[sel]
        max_pre = int(seq_lens.max()) if sel.numel() else 0
        kmeta = AttentionMetadata(
            slot_mapping=meta.slot_mapping.index_select(0, kept_rows.to(meta.slot_mapping.device)),
            num_decode_tokens=rd,
            decode_block_tables=meta.decode_block_tables,
            decode_seq_lens=meta.decode_seq_lens,
            num_prefills=int(sel.numel()),
            prefill_query_lens=qlens,
            prefill_seq_lens=seq_lens,
            prefill_block_tables=meta.prefill_block_tables[sel.to(meta.prefill_block_tables.device),
                                                           :-(-max_pre // self.block_size)].contiguous(),
            max_prefill_query_len=int(qlens.max()) if sel.numel() else 0,
            max_prefill_seq_len=max_pre,
            max_decode_seq_len=meta.max_decode_seq_len,
        )
        self.attn.prepare(kmeta, self.block_size)
        return self.model.kept_rows(kept_rows.to(self.device), kmeta), torch.searchsorted(kept_rows, rows)

    def _prompt_logprobs(self, hidden: torch.Tensor, scored: list[tuple[Sequence, int, int, int]]
                         ) -> list[PromptLogprobs]:
        """The prompt logprobs of ``scored`` chunks: (sequence, its first position to score, that
        position's row in ``hidden``, how many), each position scoring the prompt token after it,
        from the LM head's logits ``PROMPT_LOGPROBS_ROWS`` rows at a time."""
        rows = torch.cat([torch.arange(row, row + n) for _, _, row, n in scored])
        targets = torch.cat([torch.tensor(s.request.prompt_token_ids[p + 1:p + 1 + n]) for s, p, _, n in scored])
        k = min(max(s.params.prompt_logprobs for s, *_ in scored), self.vocab_size)
        # Straight from the LM head's GEMM where it runs on ours (no logits written: the whole step's
        # rows at once); else through the logits, PROMPT_LOGPROBS_ROWS rows at a time.
        fused = self.model.logprobs_from_hidden(hidden.index_select(0, rows.to(hidden.device)), targets, k,
                                                self.vocab_size)
        if fused is not None:
            parts = [fused]
        else:
            parts = []
            for i in range(0, rows.shape[0], PROMPT_LOGPROBS_ROWS):
                chunk = rows[i:i + PROMPT_LOGPROBS_ROWS].to(hidden.device)
                logits = self.model.compute_logits(hidden.index_select(0, chunk))
                parts.append(self.sampler.logprobs(logits[:, :self.vocab_size], targets[i:i + PROMPT_LOGPROBS_ROWS], k))
        lps, ranks, top_ids, top_lps = (torch.cat(x).tolist() for x in zip(*parts))
        out, i = [], 0
        for s, p, _, n in scored:
            out.append(PromptLogprobs(s.request, p + 1, lps[i:i + n], ranks[i:i + n], top_ids[i:i + n],
                                      top_lps[i:i + n]))
            i += n
        return out

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, forks: dict[int, list[Sequence]], structured_output=None
                ) -> tuple[list[Sequence], SamplerOutput | None, list[PromptLogprobs]]:
        """Run one step. Returns the sequences that got a new token (in row order; a sequence with
        a speculative draft once per verified position, in consecutive rows), the sampler's output,
        and the prompt logprobs this step's prefill chunks computed for the requests that asked.
        ``forks`` maps a parent seq_id to the children that sample from the parent's logits row
        this step (``n > 1``). ``structured_output`` (a ``StructuredOutputManager``) is passed only
        while some live request is constrained."""
        self._move_blocks(out)
        if not out.seqs:
            return [], None, []
        # Decodes first, then prefill chunks. A decode with a speculative draft is 1 + len(draft)
        # decode rows, one per position (consecutive), each attending as a plain decode of that
        # position would: the decode kernel runs them as one item that reads the context once, and
        # gives each the bits a decode step at that position gives. A one-token chunk of a prompt
        # (the chunking or a prefix-cache hit left one token) stays a prefill chunk: the decode
        # kernel's bits differ from the prefill kernel's, and a prompt's rows must not depend on
        # how it was chunked.
        is_decode = [bool(s.spec_token_ids) or (n == 1 and s.num_output_tokens > 0)
                     for s, n in zip(out.seqs, out.num_new_tokens)]
        order = sorted(range(len(out.seqs)), key=lambda i: not is_decode[i])
        seqs = [out.seqs[i] for i in order]
        num_new = [out.num_new_tokens[i] for i in order]
        starts = [s.num_computed_tokens for s in seqs]
        num_decodes = sum(is_decode)  # sequences

        input_ids: list[int] = []
        for s, st in zip(seqs[:num_decodes], starts):
            input_ids.append(s.token_ids[st])
            input_ids.extend(s.spec_token_ids)
        for s, st, n in zip(seqs[num_decodes:], starts[num_decodes:], num_new[num_decodes:]):
            input_ids.extend(s.token_ids[st:st + n])

        # The step's index arithmetic in numpy, handed to torch without copies: in a step a torch
        # op on a handful of ints cost 5-90 us, numpy's a few (a one-sequence decode step's host
        # time 724 -> 535 us: bench/RESULTS.md, bench/host_share.py).
        b = len(seqs)
        num_new_n = np.array(num_new, dtype=np.int64)
        starts_n = np.array(starts, dtype=np.int64)
        seq_lens_n = starts_n + num_new_n
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = np.zeros((b, max_blocks), dtype=np.int32)
        for i, s in enumerate(seqs):
            tables[i, :len(s.block_table)] = s.block_table

        t = len(input_ids)
        cu = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(num_new_n, out=cu[1:])
        seq_idx = np.repeat(np.arange(b), num_new_n)
        positions = np.arange(t) + (starts_n - cu[:-1])[seq_idx]
        bs = self.block_size
        slot_mapping = tables[seq_idx, positions // bs].astype(np.int64) * bs + positions % bs

        bd = num_decodes
        rd = int(cu[bd])  # decode rows
        if rd == bd:
            dec_lens, dec_tables = seq_lens_n[:bd], tables[:bd]
        else:  # speculative rows: each position's own length, its sequence's table
            dec_lens, dec_tables = positions[:rd] + 1, tables[seq_idx[:rd]]
        max_dec = int(dec_lens.max()) if bd else 0
        max_pre = int(seq_lens_n[bd:].max()) if b > bd else 0
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping),
            num_decode_tokens=rd,
            decode_block_tables=torch.from_numpy(np.ascontiguousarray(dec_tables[:, :-(-max_dec // bs)])),
            decode_seq_lens=torch.from_numpy(dec_lens.astype(np.int32)),
            num_prefills=b - bd,
            prefill_query_lens=torch.from_numpy(num_new_n[bd:]),
            prefill_seq_lens=torch.from_numpy(seq_lens_n[bd:]),
            prefill_block_tables=torch.from_numpy(np.ascontiguousarray(tables[bd:, :-(-max_pre // bs)])),
            max_prefill_query_len=max(num_new[bd:], default=0),
            max_prefill_seq_len=max_pre,
            max_decode_seq_len=max_dec,
        )
        seq_idx, positions = torch.from_numpy(seq_idx), torch.from_numpy(positions)
        self.attn.prepare(meta, bs)

        # Only sequences whose pending tokens are now all computed sample a token; a decode with a
        # speculative draft samples at each of its 1 + len(draft) positions (consecutive rows).
        rows, sampled = [], []
        cu_list = cu.tolist()
        for i, s in enumerate(seqs):
            if s.spec_token_ids:
                rows.extend(range(cu_list[i], cu_list[i + 1]))
                sampled.extend([s] * num_new[i])
            elif starts[i] + num_new[i] == s.num_tokens:
                last = cu_list[i + 1] - 1
                for target in (s, *forks.get(s.seq_id, ())):
                    rows.append(last)
                    sampled.append(target)
        # Prompt logprobs: the rows of a chunk whose next token is a prompt token its request has no
        # logprob for yet (a recompute after preemption scores nothing twice). With the chunk's
        # sampled row they are its last rows, as the last layer's kept rows must be.
        scored = []  # (sequence, first position, its row, rows)
        for i in range(bd, b):
            s = seqs[i]
            if s.request.prompt_logprobs is not None:
                lo = max(starts[i], len(s.request.prompt_logprobs) - 1)
                hi = min(starts[i] + num_new[i], s.num_prompt_tokens - 1)
                if lo < hi:
                    scored.append((s, lo, cu_list[i] + lo - starts[i], hi - lo))
        # rows_t: where each sampled row's final hidden state is in the forward's output.
        keep, rows_t = None, torch.tensor(rows, dtype=torch.int64)
        if self.prune_last_layer and b > bd and self.attn.prefill_rows_independent(self.dtype):
            scored_rows = [torch.arange(row, row + n) for _, _, row, n in scored]
            keep, kept_at = self._kept_rows(torch.cat([rows_t, *scored_rows]), meta, seq_idx, t, bd)
            rows_t = kept_at[:len(rows)]
            if scored:  # each scored run's rows are consecutive among the kept ones too
                firsts = kept_at[len(rows) + torch.tensor([0, *(n for *_, n in scored)][:-1]).cumsum(0)].tolist()
                scored = [(s, p, row, n) for (s, p, _, n), row in zip(scored, firsts)]

        hidden = self.model(torch.tensor(input_ids, device=self.device), positions.to(self.device),
                            self.kv_caches, meta, self.attn, self.layer_ops, keep)
        prompt_logprobs = self._prompt_logprobs(hidden, scored) if scored else []
        if not rows:
            return [], None, prompt_logprobs
        if forks or len(rows) != hidden.shape[0]:
            # (without forks every sampled row is a different row, in order: all of them is all)
            hidden = hidden.index_select(0, rows_t.to(self.device))
        batch = SamplingBatch(
            params=[s.params for s in sampled],
            prompt_token_ids=[s.request.prompt_token_ids for s in sampled],
            output_token_ids=[s.token_ids[s.num_prompt_tokens:] for s in sampled],
            generators=[s.generator for s in sampled],
            structured=structured_output.batch(sampled) if structured_output is not None else None,
        )
        if batch.argmax_only:
            # Greedy rows only: the argmax inside the LM head's GEMM where it runs on ours (the
            # same index as the sampler's argmax of the logits, which are then never written).
            tokens = self.model.greedy_tokens(hidden, self.sampler.vocab_size)
            if tokens is not None:
                return sampled, SamplerOutput(tokens, None, None, None), prompt_logprobs
        return sampled, self.sampler(self.model.compute_logits(hidden), batch), prompt_logprobs
