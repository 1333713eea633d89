"""The step-level engine: ``add_request`` / ``abort_request`` / ``step``.

One ``step()`` schedules a batch, runs one forward, samples, detokenizes, applies stop
conditions and returns a ``RequestOutput`` for every request that advanced (by one token, or by
several where a speculative draft was accepted). The offline ``LLM`` and the gRPC engine service
both drive exactly this loop; the engine is not thread-safe, its caller owns it from one thread.
"""
from __future__ import annotations

import gc
import itertools
import logging
import time
from collections.abc import Iterable

from engine_service.config import EngineConfig
from engine_service.detokenizer import IncrementalDetokenizer, token_texts
from engine_service.model_loader import (generation_eos_token_ids, iterate_weights, load_config,
                                         load_tokenizer, resolve_model_dir)
from engine_service.model_runner import ModelRunner, PromptLogprobs, kv_bytes_per_block
from engine_service.outputs import CompletionOutput, Logprob, RequestOutput
from engine_service.sampler import SamplerOutput, make_generator
from engine_service.sampling_params import RequestOutputKind, SamplingParams
from engine_service.scheduler import Scheduler
from engine_service.sequence import Request, RequestMetrics, Sequence, SequenceStatus
from engine_service.spec_decode import accept

logger = logging.getLogger("pagoda.engine")

PromptType = str | list[int] | dict


class LLMEngine:
    """Holds the model, tokenizer, scheduler and request table of one engine."""

    def __init__(self, config: EngineConfig):
        t0 = time.perf_counter()
        self.config = config
        self.model_dir = resolve_model_dir(config.model)
        self.model_config = load_config(self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.eos_token_ids = generation_eos_token_ids(self.model_dir, self.tokenizer)
        config.finalize(self.model_config.max_position_embeddings,
                        kv_bytes_per_block(self.model_config, config))
        self.vocab_size = self.model_config.vocab_size
        self.token_texts = token_texts(self.tokenizer, self.vocab_size)  # Logprob.decoded_token by id
        self.runner = ModelRunner(config, self.model_config, iterate_weights(self.model_dir), self.eos_token_ids)
        self.scheduler = Scheduler(config)
        self.requests: dict[str, Request] = {}
        self._child_seeds = itertools.count(1)
        self._structured_output = None  # StructuredOutputManager, made at the first constrained request
        self.num_structured_requests = 0  # live requests with structured_outputs
        # The model, tokenizer and libraries are long-lived: move them out of the cyclic GC's
        # generations so the collections that per-step allocations trigger do not walk them
        # (gc_collect_main was ~1.3% of a throughput run's samples before).
        gc.collect()
        gc.freeze()
        max_concurrency = config.num_kv_blocks * config.block_size / config.max_model_len
        logger.info(
            "engine ready in %.1f s: model %s (%s), dtype %s (matmuls in %s), %d KV blocks of %d tokens "
            "(%d tokens); maximum concurrency for %d tokens per request: %.2fx",
            time.perf_counter() - t0, self.model_dir, self.model_config.model_type, config.dtype,
            str(self.runner.matmul_dtype).removeprefix("torch."),
            config.num_kv_blocks, config.block_size, config.num_kv_blocks * config.block_size,
            config.max_model_len, max_concurrency)

    # ---- requests -----------------------------------------------------------------------------

    def validate_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: this engine's max_logprobs and vocabulary."""
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > self.config.max_logprobs:
                raise ValueError(f"SamplingParams.{name} is {asked}, above this engine's max_logprobs "
                                 f"({self.config.max_logprobs})")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"SamplingParams.{name} contains {bad[0]}, outside the vocabulary "
                                 f"[0, {self.vocab_size})")

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's token sequences: the word as it stands (leading whitespace dropped) and
        after a space, the form it takes inside a text; the same sequence once."""
        sequences: dict[tuple[int, ...], None] = {}
        for word in words:
            word = word.lstrip()
            for text in (word, " " + word):
                sequences[tuple(self.tokenizer.encode(text, add_special_tokens=False))] = None
        return [list(s) for s in sequences if s]

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Accepts a string, a list of token ids, or {"prompt": ...} / {"prompt_token_ids": ...}."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt dict must have a 'prompt' or 'prompt_token_ids' key")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def truncate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt's last ``params.truncate_prompt_tokens`` tokens (all of them when unset)."""
        k = params.truncate_prompt_tokens
        if k is None:
            return prompt_token_ids
        if k == -1:
            k = self.config.max_model_len - 1
        return prompt_token_ids[-k:] if len(prompt_token_ids) > k else prompt_token_ids

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty: it must have at least 1 token")
        if n >= self.config.max_model_len:
            raise ValueError(f"prompt has {n} tokens, but max_model_len is {self.config.max_model_len}: "
                             f"the prompt must be at most {self.config.max_model_len - 1} tokens")
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids contains {bad[0]!r}, outside the vocabulary [0, {self.vocab_size})")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> Request:
        """Queue a request. Raises ValueError (and queues nothing) when it is invalid."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = (params or SamplingParams()).clone()
        text, token_ids = self.tokenize_prompt(prompt)
        token_ids = self.truncate_prompt(token_ids, params)
        self.validate_prompt(token_ids)
        self.validate_params(params)
        if params.bad_words:
            params.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        grammar_key = None
        if params.structured_outputs is not None:
            grammar_key = self.structured_output.compile(params.structured_outputs)
        room = self.config.max_model_len - len(token_ids)
        params.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        params.min_tokens = min(params.min_tokens, params.max_tokens)
        request = Request(request_id, text, token_ids, params,
                          RequestMetrics(arrival_time if arrival_time is not None else time.time()), priority,
                          grammar_key=grammar_key, prompt_logprobs=None if params.prompt_logprobs is None else [None])
        seq = self._new_sequence(request, 0, list(token_ids))
        seq.num_pending_forks = params.n - 1
        self.requests[request_id] = request
        if grammar_key is not None:
            self.num_structured_requests += 1
        self.scheduler.add(seq)
        return request

    def _new_sequence(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        params = request.params
        generator = None
        if params.seed is not None:
            generator = make_generator(params.seed + index)
        seq = Sequence(request, index, token_ids, generator)
        if params.detokenize:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params)
        if request.grammar_key is not None:
            seq.grammar = self.structured_output.new_matcher(request.grammar_key, params.structured_outputs)
        request.seqs.append(seq)
        return seq

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Abort requests now: their KV blocks are free when this returns."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for rid in request_ids:
            request = self._pop_request(rid)
            if request is None:
                continue
            for seq in request.seqs:
                seq.num_pending_forks = 0
                if not seq.is_finished:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            request.metrics.finished_time = time.time()
            outputs.append(self._make_output(request, {}, request.is_finished))
        return outputs

    def _pop_request(self, request_id: str) -> Request | None:
        request = self.requests.pop(request_id, None)
        if request is not None and request.grammar_key is not None:
            self.num_structured_requests -= 1
        return request

    @property
    def structured_output(self):
        """The ``StructuredOutputManager`` (made on first use: it loads llguidance and indexes the vocabulary)."""
        if self._structured_output is None:
            from engine_service.structured_output import StructuredOutputManager

            self._structured_output = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._structured_output

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        now = time.time()
        forks: dict[int, list[Sequence]] = {}
        for seq, n in zip(out.seqs, out.num_new_tokens):
            metrics = seq.request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
            if seq.num_pending_forks and seq.num_computed_tokens + n == seq.num_tokens:
                forks[seq.seq_id] = self._fork(seq, seq.num_computed_tokens + n)
        sampled, sampler_out, prompt_logprobs = self.runner.execute(
            out, forks, self._structured_output if self.num_structured_requests else None)
        if prompt_logprobs:
            self._record_prompt_logprobs(prompt_logprobs)
        for seq, n in zip(out.seqs, out.num_new_tokens):
            # A draft's positions count as computed once accepted (in _process).
            seq.num_computed_tokens += n - len(seq.spec_token_ids)
        if sampler_out is None:
            return []
        return self._process(sampled, sampler_out)

    def _fork(self, parent: Sequence, num_computed: int) -> list[Sequence]:
        children = []
        for _ in range(parent.num_pending_forks):
            child = self._new_sequence(parent.request, len(parent.request.seqs), list(parent.token_ids))
            self.scheduler.fork(parent, child)
            child.num_computed_tokens = num_computed
            children.append(child)
        parent.num_pending_forks = 0
        return children

    def _process(self, sampled: list[Sequence], so: SamplerOutput) -> list[RequestOutput]:
        now = time.time()
        token_ids = so.sampled_token_ids.tolist()
        logprob_rows = self._logprob_rows(sampled, so, token_ids)
        touched: dict[str, dict[int, int]] = {}  # request id -> {seq id: tokens appended this step}
        row = 0
        while row < len(sampled):
            seq = sampled[row]
            draft = seq.spec_token_ids
            lp = None
            if draft:
                # Rows row .. row + len(draft) verify the draft: keep the model's tokens up to and
                # including the first disagreement; the accepted draft positions' KV is valid.
                kept = accept(draft, token_ids[row:row + len(draft) + 1])
                self.scheduler.num_draft_tokens += len(draft)
                self.scheduler.num_accepted_tokens += len(kept) - 1
                seq.num_computed_tokens += len(kept) - 1
                seq.spec_token_ids = []
                row += len(draft) + 1
            else:
                kept = [token_ids[row]]
                lp = logprob_rows[row] if logprob_rows is not None else None
                row += 1
            n = 0
            for token in kept:  # stop at the first token that finishes the sequence
                n += 1
                if self._append_token(seq, token, lp, now):
                    break
            stepped = touched.setdefault(seq.request.request_id, {})
            stepped[seq.seq_id] = stepped.get(seq.seq_id, 0) + n
        outputs = []
        for rid, stepped in touched.items():
            request = self.requests[rid]
            finished = request.is_finished
            if finished:
                request.metrics.finished_time = now
                self._pop_request(rid)
            if finished or request.params.output_kind != RequestOutputKind.FINAL_ONLY:
                outputs.append(self._make_output(request, stepped, finished))
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprob_row, now: float) -> bool:
        """Append one sampled token to ``seq`` and apply the stop rules; True when it finished."""
        request = seq.request
        seq.token_ids.append(token)
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        if logprob_row is not None and seq.logprobs is not None:
            seq.cumulative_logprob += logprob_row[0]
            seq.logprobs.append(logprob_row[1])
        status = self._check_stop(seq, token)
        if seq.grammar is not None and self._advance_grammar(seq, token) and status is None:
            status = SequenceStatus.FINISHED_STOPPED
        if status is not None:
            self.scheduler.finish(seq, status)
            return True
        return False

    def _logprob_rows(self, sampled: list[Sequence], so: SamplerOutput, token_ids: list[int]):
        """Per row: (sampled token's logprob, {token id: Logprob} with the top k first, by rank, then the
        sampled token where it is not among them)."""
        if so.sampled_logprobs is None:
            return None
        lps = so.sampled_logprobs.tolist()
        ranks = so.sampled_ranks.tolist() if so.sampled_ranks is not None else [None] * len(lps)
        top_ids = so.topk_token_ids.tolist() if so.topk_token_ids is not None else None
        top_lps = so.topk_logprobs.tolist() if so.topk_logprobs is not None else None
        rows = []
        for row, seq in enumerate(sampled):
            k = seq.params.logprobs
            if k is None:
                rows.append(None)
                continue
            top = (top_ids[row][:k], top_lps[row][:k]) if k and top_ids is not None else ((), ())
            texts = self.token_texts if seq.params.detokenize else None
            rows.append((lps[row], _logprob_entry(*top, token_ids[row], lps[row], ranks[row], texts)))
        return rows

    def _record_prompt_logprobs(self, scored: list[PromptLogprobs]) -> None:
        """Append each chunk's prompt logprobs to its request's: per position, the top
        ``prompt_logprobs`` (ranks 1..k) first, then the prompt token with its logprob and rank where
        it is not among them, as vLLM's ``prompt_logprobs``."""
        for pl in scored:
            entries = pl.request.prompt_logprobs
            assert len(entries) == pl.first, (len(entries), pl.first)  # in order, each position once
            k = pl.request.params.prompt_logprobs
            texts = self.token_texts if pl.request.params.detokenize else None
            targets = pl.request.prompt_token_ids[pl.first:pl.first + len(pl.logprobs)]
            for target, lp, rank, ids, tops in zip(targets, pl.logprobs, pl.ranks, pl.top_ids, pl.top_logprobs):
                entries.append(_logprob_entry(ids[:k], tops[:k], target, lp, rank, texts))

    def _advance_grammar(self, seq: Sequence, token: int) -> bool:
        """Move the sequence's grammar past ``token``; True when the grammar is complete (stop there)."""
        if not seq.grammar.accept(token):
            # Only reachable when every allowed token was also forbidden by something else; end
            # the sequence rather than emit text the grammar rejects.
            logger.warning("request %s: token %d is outside its structured_outputs grammar (%s); stopping",
                           seq.request.request_id, token, seq.grammar.error)
            return True
        return seq.grammar.is_terminated

    def _check_stop(self, seq: Sequence, token: int) -> SequenceStatus | None:
        params = seq.params
        det = seq.detokenizer
        stop_str = det.update([token]) if det is not None else None
        n_tokens = len(seq.token_ids)
        n_out = n_tokens - seq.num_prompt_tokens
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
            if stop_str is not None:
                seq.stop_reason = stop_str
                return SequenceStatus.FINISHED_STOPPED
        if n_out >= params.max_tokens or n_tokens >= self.config.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _make_output(self, request: Request, stepped: dict[int, int], finished: bool) -> RequestOutput:
        """The request's output now. ``stepped``: tokens each sequence gained this step, i.e. the
        delta (``FINAL_ONLY`` hands out nothing before, so its delta is the whole completion);
        ``finished``: ``request.is_finished``."""
        kind = request.params.output_kind
        completions = []
        seqs = request.seqs
        for seq in sorted(seqs, key=lambda s: s.index) if len(seqs) > 1 else seqs:
            status = seq.status
            det = seq.detokenizer
            delta_text = det.get_delta(status.is_finished) if det is not None else ""
            out_ids = seq.token_ids[seq.num_prompt_tokens:]
            new = len(out_ids) if kind == RequestOutputKind.FINAL_ONLY else stepped.get(seq.seq_id, 0)
            delta_ids = out_ids[len(out_ids) - new:] if new else []
            delta_logprobs = seq.logprobs[-new:] if (new and seq.logprobs) else None
            if kind == RequestOutputKind.DELTA:
                text, ids, logprobs = delta_text, delta_ids, seq.logprobs and (delta_logprobs or [])
            else:
                text, ids, logprobs = det.output_text if det is not None else "", out_ids, seq.logprobs
            completions.append(CompletionOutput(
                index=seq.index,
                text=text,
                token_ids=ids,
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                logprobs=logprobs,
                finish_reason=status.finish_reason,
                stop_reason=seq.stop_reason,
                delta_text=delta_text,
                delta_token_ids=delta_ids,
                delta_logprobs=delta_logprobs,
            ))
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=request.metrics,
            num_cached_tokens=request.seqs[0].num_cached_tokens if request.seqs else 0,
            prompt_logprobs=request.prompt_logprobs,
        )


def _logprob_entry(top_ids, top_lps, token: int, lp: float, rank: int | None,
                   texts: list[str] | None) -> dict[int, Logprob]:
    """One position's ``{token id: Logprob}`` as vLLM gives it: the top k first (ranks 1..k), then
    ``token`` with its own logprob and rank where it is not among them; texts where detokenizing."""
    entry = {tid: Logprob(top, r, texts[tid] if texts else None)
             for r, (tid, top) in enumerate(zip(top_ids, top_lps), start=1)}
    if token not in entry:
        entry[token] = Logprob(lp, rank, texts[token] if texts else None)
    return entry
