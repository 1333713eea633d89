"""Pagoda engine: paged-KV continuous-batching generation, offline `LLM` API and the engine service."""
from engine_service import cpu_malloc

cpu_malloc.enable_torch_huge_pages()  # before torch allocates anything (see there)

from engine_service.config import EngineConfig
from engine_service.llm import LLM
from engine_service.llm_engine import LLMEngine
from engine_service.outputs import CompletionOutput, Logprob, RequestOutput
from engine_service.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "StructuredOutputsParams", "RequestOutputKind",
           "RequestOutput", "CompletionOutput", "Logprob"]
