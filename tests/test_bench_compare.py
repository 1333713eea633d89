"""bench/compare.py's own logic: which revision its figures belong to, and how it judges the targets."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("pagoda_bench_compare", ROOT / "bench" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tree(root: Path) -> None:
    for rel, text in {"engine_service/a.py": "x = 1\n", "kernels/csrc/k.cpp": "int f();\n",
                      "router/r.py": "y = 2\n", "docs/notes.md": "notes\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_source_digest_follows_the_sources_a_run_loads(compare, tmp_path):
    _tree(tmp_path)
    first = compare.source_digest(tmp_path)
    assert compare.source_digest(tmp_path) == first
    (tmp_path / "docs/notes.md").write_text("other notes\n")  # not loaded by a run
    (tmp_path / "kernels/__pycache__").mkdir()
    (tmp_path / "kernels/__pycache__/k.py").write_text("cached\n")
    assert compare.source_digest(tmp_path) == first
    (tmp_path / "kernels/csrc/k.cpp").write_text("int f(); // edited\n")
    edited = compare.source_digest(tmp_path)
    assert edited != first
    (tmp_path / "kernels/csrc/k.cpp").rename(tmp_path / "kernels/csrc/k2.cpp")  # same bytes, other file
    assert compare.source_digest(tmp_path) not in (first, edited)


def test_revision_marks_uncommitted_source_changes(compare, tmp_path):
    _tree(tmp_path)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "tree"]):
        subprocess.run(["git", *cmd], cwd=tmp_path, env=env, check=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert compare.revision(tmp_path) == head
    (tmp_path / "docs/notes.md").write_text("other notes\n")
    assert compare.revision(tmp_path) == head
    (tmp_path / "engine_service/a.py").write_text("x = 3\n")
    assert compare.revision(tmp_path) == f"{head} with uncommitted changes to its sources"
    assert compare.revision(tmp_path / "docs") != "no git"  # a subfolder still finds the checkout
    bare = tmp_path.parent / f"{tmp_path.name}-bare"
    bare.mkdir()
    assert compare.revision(bare) == "no git"


def _row(engine: str, workload: str, tok_s: float, ttft_p50: float | None = None) -> dict:
    row = {"engine": engine, "workload": workload, "output_tokens": int(tok_s * 10), "elapsed": 10.0}
    if ttft_p50 is not None:
        row["ttft_p50"] = ttft_p50
    return row


def test_target_lines_judge_each_target_on_the_rows(compare):
    pagoda = _row("pagoda (matmul bfloat16)", "W", 900.0, ttft_p50=6.0)
    vllm_slow = _row("vllm 0.32.0", "W", 600.0, ttft_p50=8.0)
    vllm_close = _row("vllm 0.32.0", "W", 800.0, ttft_p50=5.0)
    hf = _row("transformers 5.24.0 hf-single", "W-small", 30.0)
    met = compare.target_lines(pagoda, [pagoda, vllm_slow, hf], "bfloat16")
    assert met == [
        "target bfloat16 >= 1.3x vLLM-CPU: 1.50x, met",
        "target TTFT p50 not worse than vLLM-CPU's: 6.0 against 8.0 s, met",
        "target bf16 >= 24x transformers one prompt at a time: 30.00x (Pagoda on W, transformers on W-small), met",
    ]
    missed = compare.target_lines(pagoda, [pagoda, vllm_close], "bfloat16")
    assert missed == ["target bfloat16 >= 1.3x vLLM-CPU: 1.12x, NOT met",
                      "target TTFT p50 not worse than vLLM-CPU's: 6.0 against 5.0 s, NOT met"]
    # fp32 has its own bar (1.1x), and the transformers target is a bf16 one.
    assert compare.target_lines(pagoda, [pagoda, vllm_close, hf], "float32")[0] == \
        "target float32 >= 1.1x vLLM-CPU: 1.12x, met"
    assert len(compare.target_lines(pagoda, [pagoda, vllm_close, hf], "float32")) == 2
    # A vLLM row on another workload is not the like-for-like comparison.
    assert compare.target_lines(pagoda, [pagoda, _row("vllm 0.32.0", "W-small", 100.0)], "bfloat16") == []


def test_closing_lines_judge_no_target_when_the_sources_changed(compare):
    pagoda = _row("pagoda (matmul bfloat16)", "W", 900.0, ttft_p50=6.0)
    rows = [pagoda, _row("vllm 0.32.0", "W", 600.0, ttft_p50=8.0)]
    judged = compare.closing_lines(pagoda, rows, "bfloat16", ("abc", "abc"), speculative=False)
    assert judged == compare.target_lines(pagoda, rows, "bfloat16") and len(judged) == 2
    changed = compare.closing_lines(pagoda, rows, "bfloat16", ("abc", "def"), speculative=False)
    assert len(changed) == 1 and changed[0].startswith("!! Pagoda's sources changed")
    assert "abc" in changed[0] and "def" in changed[0] and "no target is judged" in changed[0]
    assert compare.closing_lines(pagoda, rows, "bfloat16", ("abc", "abc"), speculative=True) == []
    assert compare.closing_lines(None, rows[1:], "bfloat16", ("abc", "abc"), speculative=False) == []
    sampled = compare.closing_lines(pagoda, rows, "bfloat16", ("abc", "abc"), speculative=False,
                                    settings="temperature 0.8, top_p 0.95, top_k 0")
    assert len(sampled) == 1 and "not judged" in sampled[0] and "top_p 0.95" in sampled[0]
    one_at_a_time = compare.closing_lines(pagoda, rows, "bfloat16", ("abc", "abc"), speculative=False,
                                          settings="max_num_seqs 1")
    assert len(one_at_a_time) == 1 and "not judged" in one_at_a_time[0] and "max_num_seqs 1" in one_at_a_time[0]


def test_step_budget_goes_to_pagoda_and_vllm_only(compare, tmp_path, monkeypatch):
    venv = tmp_path / "vllm"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    monkeypatch.setattr(compare, "VLLM_VENV", venv)
    monkeypatch.setattr("engine_service.model_loader.resolve_model_dir", lambda name: "/model")  # no GGUF conversion
    args = compare.argparse.Namespace(dtype="bfloat16", workload="W", hf_workload="W-small", matmul_dtype=None,
                                      num_speculative_tokens=0, max_num_batched_tokens=4096, max_num_seqs=1,
                                      temperature=0.0, top_p=1.0, top_k=0, logprobs=None, prompt_logprobs=None,
                                      kv_cache_dtype=None)
    for engine in ("pagoda", "vllm", "hf-single"):
        py, cmd, env = compare.engine_command(engine, args)
        budget = cmd[cmd.index("--max-num-batched-tokens") + 1] if "--max-num-batched-tokens" in cmd else None
        assert budget == ("4096" if engine in ("pagoda", "vllm") else None), (engine, cmd)
        seqs = cmd[cmd.index("--max-num-seqs") + 1] if "--max-num-seqs" in cmd else None
        assert seqs == ("1" if engine in ("pagoda", "vllm") else None), (engine, cmd)
        if engine == "vllm":
            assert py == str(venv / "bin" / "python") and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    args.max_num_batched_tokens = args.max_num_seqs = None
    assert not {"--max-num-batched-tokens", "--max-num-seqs"} & set(compare.engine_command("pagoda", args)[1])
    plain = compare.engine_command("pagoda", args)[1]
    assert not {"--temperature", "--logprobs", "--prompt-logprobs"} & set(plain)  # greedy: the workload's own
    # Sampling settings reach Pagoda and vLLM alike, and no baseline that cannot take them.
    args.temperature, args.top_p, args.top_k, args.logprobs, args.prompt_logprobs = 0.8, 0.95, 40, 0, 2
    for engine in ("pagoda", "vllm", "hf-single"):
        cmd = compare.engine_command(engine, args)[1]
        if engine == "hf-single":
            assert "--temperature" not in cmd and "--logprobs" not in cmd and "--prompt-logprobs" not in cmd
        else:
            i = cmd.index("--temperature")
            assert cmd[i:i + 6] == ["--temperature", "0.8", "--top-p", "0.95", "--top-k", "40"], (engine, cmd)
            assert cmd[cmd.index("--logprobs") + 1] == "0", (engine, cmd)
            assert cmd[cmd.index("--prompt-logprobs") + 1] == "2", (engine, cmd)
    # A one-byte KV cache reaches both engines alike (vLLM's kv_cache_dtype), and no other.
    assert "--kv-cache-dtype" not in plain
    args.kv_cache_dtype = "fp8_e5m2"
    for engine in ("pagoda", "vllm", "hf-single"):
        cmd = compare.engine_command(engine, args)[1]
        kv = cmd[cmd.index("--kv-cache-dtype") + 1] if "--kv-cache-dtype" in cmd else None
        assert kv == (None if engine == "hf-single" else "fp8_e5m2"), (engine, cmd)


@pytest.mark.parametrize("option,value,message", [("--temperature", "-0.5", "--temperature must be >= 0"),
                                                  ("--top-p", "0", "--top-p must be in (0, 1]"),
                                                  ("--top-p", "1.5", "--top-p must be in (0, 1]"),
                                                  ("--top-k", "-3", "--top-k must be >= 0"),
                                                  ("--logprobs", "-1", "--logprobs must be >= 0"),
                                                  ("--prompt-logprobs", "-2", "--prompt-logprobs must be >= 0"),
                                                  ("--max-num-seqs", "0", "--max-num-seqs must be >= 1")])
def test_bad_sampling_options_are_refused_before_anything_runs(option, value, message):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "compare.py"), option, value],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and message in run.stderr and "matmul" not in run.stdout


_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 207
model name\t: Intel(R) Xeon(R) Platinum
flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile

processor\t: 1
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu avx2
"""


def test_host_description_names_the_kind_a_command_ran_on(compare):
    assert compare.host_description(_CPUINFO, 2) == (
        "Intel(R) Xeon(R) Platinum (family 6 model 207; AMX_BF16, AVX512_BF16, AVX512F, AVX2), 2 CPUs")
    zen3 = _CPUINFO.split("\n\n", 1)[1].replace("processor\t: 1", "processor\t: 0")
    assert compare.host_description(zen3, 2) == "AMD EPYC (family 25 model 17; AVX2), 2 CPUs"
    bare = "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2\n"
    assert compare.host_description(bare, 4) == (
        "Some CPU (family ? model ?; none of amx_bf16/avx512_bf16/avx512f/avx2), 4 CPUs")
    assert compare.host_description("", None) == "unknown CPU, None CPUs"


@pytest.fixture(scope="module")
def hf_model(bundled_dir):
    """The bundled model in transformers, bf16, loaded once for the baselines' tests."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bundled_dir, dtype=torch.bfloat16).eval()


# Three requests of 2, 9 and 4 tokens: 15 in all, running totals 2, 11, 15.
THREE_REQUESTS = [{"id": i, "prompt_token_ids": list(range(100 + i, 140 + 7 * i)), "max_tokens": n}
                  for i, n in enumerate((2, 9, 4))]


def test_transformers_continuous_batching_baseline_serves_each_request_its_own_length(compare, hf_model, capsys):
    """engine_runner's hf-cb row: transformers' continuous batching with each request's own
    max_new_tokens (not the longest for all, which would count less work than it did), EOS off,
    and a TTFT per request; a run that returned other token counts is refused, not reported."""
    import engine_runner  # on the path compare.py puts bench/ on

    res = engine_runner.run_hf_cb(hf_model, THREE_REQUESTS)
    assert res["output_tokens"] == 15
    assert "PROGRESS 3/3 requests done, 15 tokens" in capsys.readouterr().err  # what compare.py shows live
    assert 0 < res["ttft_p50"] <= res["ttft_p99"] <= res["elapsed"]


def test_transformers_one_prompt_at_a_time_reports_each_request_as_it_finishes(compare, hf_model):
    """The hf-single row's loop: exactly each request's own token count, and the running totals
    engine_runner turns into the PROGRESS lines an hour-long W run is followed by."""
    import throughput  # on the path compare.py puts bench/ on

    seen = []
    res = throughput.run_hf_single(hf_model, THREE_REQUESTS,
                                   on_done=lambda done, tokens, seconds: seen.append((done, tokens)))
    assert seen == [(1, 2), (2, 11), (3, 15)] and res["output_tokens"] == 15


def test_run_engine_shows_progress_as_it_comes_and_reads_the_result(compare, monkeypatch, capsys):
    """A baseline that runs for an hour shows its PROGRESS lines while it runs; the rest of its
    output stays captured, the RESULT line is the row, and a failed run raises with its tail."""
    child = ("import sys, json; print('chatter', file=sys.stderr); "
             "print('PROGRESS 8/16 requests done', file=sys.stderr, flush=True); "
             "print('RESULT ' + json.dumps({'output_tokens': 5, 'elapsed': 2.0})); sys.exit(int(sys.argv[1]))")
    monkeypatch.setattr(compare, "engine_command", lambda engine, args: (sys.executable, ["-c", child, args], {}))
    res = compare.run_engine("hf-cb", "0")
    assert res["output_tokens"] == 5 and res["elapsed"] == 2.0 and res["wall"] > 0
    shown = capsys.readouterr().err
    assert "hf-cb: 8/16 requests done" in shown and "chatter" not in shown
    with pytest.raises(RuntimeError, match=r"(?s)hf-cb failed \(rc 3\).*RESULT.*chatter"):
        compare.run_engine("hf-cb", "3")
