"""Shared fixtures: the bundled model's converted directory and a tiny random-weight Llama."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

# The engines the tests start, in this process and as services, hold a 512 MiB CPU KV cache where a
# test sets no budget of its own: the default 4 GiB is written whole at start-up (kv_cache_prefault),
# 0.4-7 s an engine on these machines, ~100 s of the suite over its ~50 such engines.
os.environ.setdefault("PAGODA_KV_CACHE_MEMORY_BYTES", "512MiB")


@pytest.fixture(scope="session")
def bundled_dir() -> str:
    """The bundled SmolLM2-135M-Instruct as a HF directory (converted once, then cached).

    ``PAGODA_TEST_MODEL_DIR`` names another HF directory instead, for a machine where the bundled
    package cannot be installed (a lent GPU machine with no package registry: bench/gpu_check.sh
    points it at a random-weight model of SmolLM2's shape with its tokenizer).
    """
    from engine_service.model_loader import resolve_model_dir

    return resolve_model_dir(os.environ.get("PAGODA_TEST_MODEL_DIR") or "bundled")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, bundled_dir) -> str:
    """A 2-layer random-weight Llama with GQA and the bundled tokenizer: fast engine tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Larger-than-default weights give peaked, non-degenerate distributions (fewer greedy ties).
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    for name in os.listdir(bundled_dir):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(bundled_dir, name), path / name)
    return str(path)


_LESSER_RUN = "test_kernel_tests_pass_built_for_a_lesser_cpu"
_background_builds = []


def pytest_collection_finish(session):
    """Where the lesser -march runs of the kernel tests are selected, build their extensions in the
    background while the tests before them run (tests/test_lesser_isa.py)."""
    marches = {item.callspec.params["march"] for item in session.items
               if getattr(item, "originalname", None) == _LESSER_RUN}
    if marches:
        from tests.test_lesser_isa import start_lesser_builds

        _background_builds.extend(start_lesser_builds(marches))


def pytest_sessionfinish(session, exitstatus):
    """A build still running (the run was cut short) is interrupted, so that torch's handler drops
    its lock in the build directory, which would otherwise hold up the next build there."""
    import signal
    import subprocess

    for build in _background_builds:
        if build.poll() is None:
            os.killpg(build.pid, signal.SIGINT)
            try:
                build.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(build.pid, signal.SIGKILL)
                build.wait()
