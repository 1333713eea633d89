"""Batch jobs over a dataset: one generation per JSONL row, crash-safe and resumable.

    python -m engine_service.batch --input requests.jsonl --output results.jsonl            # in this process
    python -m engine_service.batch --input requests.jsonl --output results.jsonl --router HOST:PORT
    python -m engine_service.batch --input requests.jsonl --output results.jsonl --engine HOST:PORT

Rows are OpenAI batch-file requests (``/v1/chat/completions``, ``/v1/completions``) or the plain
``{"id": ..., "prompt": ...}`` form (see ``engine_service.batch_rows``). Every input row gets exactly
one output row: the response in OpenAI's batch output shape, or an error object.

- Duplicate ids are reported before any work starts (exit status 2, the output untouched).
- Results are appended and flushed one row at a time as requests complete. A re-run with the same
  output skips the ids already there, so a killed job resumes where it stopped; a half-written last
  line (a kill in the middle of a write) is cut off first.
- A bad row (malformed JSON, an unknown field, a prompt that is too long, an invalid schema)
  becomes an error row; the job goes on.
- A progress bar shows rows/s, completion tokens/s and the ETA; a summary ends the job.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from tqdm.auto import tqdm

from engine_service.batch_rows import (BatchRequest, BatchResult, RowError, error_row, output_key, parse_row,
                                       row_key, success_row)
from engine_service.config import KV_CACHE_DTYPE_CHOICES

logger = logging.getLogger("pagoda.batch")


class DuplicateIds(ValueError):
    """The input has the same id on more than one row; nothing was run."""


@dataclass
class JobSummary:
    rows_total: int = 0            # rows in the input
    rows_skipped: int = 0          # already in the output before this run
    rows_ok: int = 0
    rows_failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0

    @property
    def rows_done(self) -> int:
        return self.rows_ok + self.rows_failed

    def line(self, output: str) -> str:
        wall = max(self.wall_s, 1e-9)
        return (f"batch job done in {self.wall_s:.1f} s: {self.rows_done} rows ({self.rows_ok} ok, "
                f"{self.rows_failed} failed), {self.rows_skipped} already done, {self.rows_total} in the input; "
                f"{self.prompt_tokens} prompt + {self.completion_tokens} completion tokens; "
                f"{self.rows_done / wall:.2f} rows/s, {self.completion_tokens / wall:.1f} completion tokens/s, "
                f"{(self.prompt_tokens + self.completion_tokens) / wall:.1f} total tokens/s -> {output}")


def _lines(path: str) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) of each non-blank line."""
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if text.strip():
                yield number, text


def scan_input(path: str) -> tuple[set[str], dict[str, list[int]]]:
    """Every row's key, and the keys on more than one row with their line numbers."""
    first_line: dict[str, int] = {}
    duplicates: dict[str, list[int]] = {}
    for number, text in _lines(path):
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        key = row_key(obj, number)
        if key in first_line:
            duplicates.setdefault(key, [first_line[key]]).append(number)
        else:
            first_line[key] = number
    return set(first_line), duplicates


def check_input(path: str) -> set[str]:
    """Every row's key; raises ``DuplicateIds`` listing the ids that repeat (with their lines)."""
    keys, duplicates = scan_input(path)
    if duplicates:
        shown = "; ".join(f"{k!r} on lines {', '.join(map(str, lines))}" for k, lines in list(duplicates.items())[:10])
        more = f" (and {len(duplicates) - 10} more)" if len(duplicates) > 10 else ""
        raise DuplicateIds(f"{path}: {len(duplicates)} ids appear on more than one row: {shown}{more}. "
                           "Every row needs its own custom_id (or id); nothing was run.")
    return keys


def read_done(path: str) -> set[str]:
    """The keys already answered in ``path``; a partial last line (no newline) is truncated away."""
    done: set[str] = set()
    if not os.path.exists(path):
        return done
    with open(path, "rb+") as f:
        offset = 0
        for raw in f:
            if not raw.endswith(b"\n"):
                logger.warning("%s: cutting off a half-written last line (%d bytes) before resuming", path, len(raw))
                f.truncate(offset)
                break
            offset += len(raw)
            try:
                key = output_key(json.loads(raw))
            except ValueError:
                key = None
            if key is None:
                logger.warning("%s: ignoring a line that is not a batch output row at byte %d", path, offset - len(raw))
                continue
            done.add(key)
    return done


class ResultWriter:
    """Appends one JSON row per call and flushes it to the OS at once (a killed job loses no finished row)."""

    def __init__(self, path: str):
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, row: dict) -> None:
        data = (json.dumps(row, ensure_ascii=False) + "\n").encode()
        while data:  # one write(2) for any row of ordinary size; loop on a short write
            data = data[os.write(self._fd, data):]

    def close(self) -> None:
        os.fsync(self._fd)
        os.close(self._fd)


def run_job(input_path: str, output_path: str, backend, *, progress: bool = True,
            model_name: str | None = None) -> JobSummary:
    """Run every row of ``input_path`` not yet answered in ``output_path`` through ``backend``.

    Raises ``DuplicateIds`` (before any work, the output untouched) when ids repeat. Rows finished
    before an exception (a dead engine, Ctrl-C) stay written; a re-run does the rest.
    """
    t0 = time.perf_counter()
    keys = check_input(input_path)
    done = read_done(output_path)
    stray = done - keys
    if stray:
        logger.warning("%s has %d rows whose ids are not in %s (kept, not counted)", output_path, len(stray), input_path)
    summary = JobSummary(rows_total=len(keys), rows_skipped=len(done & keys))
    writer = ResultWriter(output_path)
    bar = tqdm(total=summary.rows_total - summary.rows_skipped, unit="row", desc="batch", disable=not progress,
               dynamic_ncols=True, smoothing=0.1)
    started = time.perf_counter()

    def record(row: dict, failed: bool, result: BatchResult | None = None) -> None:
        writer.write(row)
        if failed:
            summary.rows_failed += 1
        else:
            summary.rows_ok += 1
            summary.prompt_tokens += result.prompt_tokens
            summary.completion_tokens += result.completion_tokens
        elapsed = max(time.perf_counter() - started, 1e-9)
        bar.set_postfix_str(f"{summary.completion_tokens / elapsed:.0f} tok/s, {summary.rows_failed} failed",
                            refresh=False)
        bar.update(1)

    def requests() -> Iterator[BatchRequest]:
        for number, text in _lines(input_path):
            try:
                obj_key = row_key(json.loads(text), number)
            except ValueError:
                obj_key = f"line:{number}"
            if obj_key in done:
                continue
            try:
                yield parse_row(text, number)
            except RowError as e:
                custom_id = None if obj_key.startswith("line:") else obj_key
                record(error_row(obj_key, custom_id, number, e.code, str(e)), failed=True)

    def emit(req: BatchRequest, outcome: BatchResult | RowError) -> None:
        if isinstance(outcome, RowError):
            record(error_row(req.key, req.custom_id, req.line, outcome.code, str(outcome)), failed=True)
        elif any(c.finish_reason == "abort" for c in outcome.choices):
            record(error_row(req.key, req.custom_id, req.line, "aborted", "the request was aborted by the server"),
                   failed=True)
        else:
            record(success_row(req, outcome, model_name or getattr(backend, "model_name", None) or "pagoda"),
                   failed=False, result=outcome)

    try:
        backend.run(requests(), emit)
    finally:
        bar.close()
        writer.close()
        summary.wall_s = time.perf_counter() - t0
    return summary


# ---- command line --------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    from engine_service.__main__ import parse_bytes

    ap = argparse.ArgumentParser(prog="python -m engine_service.batch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, help="JSONL of requests (OpenAI batch rows or {id, prompt})")
    ap.add_argument("--output", required=True, help="JSONL of results; appended to, and skipped ids resumed")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--router", metavar="HOST:PORT", help="run through a Pagoda router (pagoda.v1.Router)")
    where.add_argument("--engine", metavar="HOST:PORT", help="run through one engine service (pagoda.v1.Engine)")
    ap.add_argument("--concurrency", type=int, default=64, help="streams open at once with --router/--engine")
    ap.add_argument("--max-retries", type=int, default=6,
                    help="retries of a row on UNAVAILABLE / RESOURCE_EXHAUSTED before the job stops")
    ap.add_argument("--tokenizer", default=None,
                    help="with --engine / --router: the model's tokenizer directory, for chat rows through --engine "
                         "and echo rows with logprobs or token ids (default with --engine: the engine's, if local)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (the summary is still printed)")
    ap.add_argument("--summary-json", default=None, help="also write the summary as JSON to this file")
    ap.add_argument("--log-level", default="WARNING")
    e = ap.add_argument_group("in-process engine (vLLM's names)")
    e.add_argument("--model", default=None, help="'bundled' (default), a HF directory or a .gguf file")
    e.add_argument("--max-in-flight", type=int, default=None,
                   help="rows handed to the engine at once (default 2 x max_num_seqs)")
    e.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--kv-cache-memory-bytes", type=parse_bytes, default=None, help="CPU KV budget, e.g. 4GiB")
    e.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                   help="one byte a K/V value, fp8 (= fp8_e4m3) or fp8_e5m2: half the attention reads, twice the "
                        "tokens a budget holds")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--device", default="cpu")
    return ap


def make_backend(args: argparse.Namespace):
    """The backend the arguments ask for, and the model name to report (None: the backend's)."""
    from engine_service.batch_backends import EngineClient, LocalBackend, RemoteBackend, RouterClient

    if args.router:
        return RemoteBackend(RouterClient(args.router, args.tokenizer), args.concurrency, args.max_retries), None
    if args.engine:
        return RemoteBackend(EngineClient(args.engine, args.tokenizer), args.concurrency, args.max_retries), None
    from engine_service.config import EngineConfig
    from engine_service.llm_engine import LLMEngine
    from engine_service.server import default_model_name

    config = EngineConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          kv_cache_memory_bytes=args.kv_cache_memory_bytes, kv_cache_dtype=args.kv_cache_dtype,
                          seed=args.seed, device=args.device)
    return LocalBackend(LLMEngine(config), args.max_in_flight), default_model_name(args.model)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # SIGTERM stops like Ctrl-C: finished rows are written, the rest are done by a re-run.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if not os.path.exists(args.input):
        print(f"error: --input {args.input}: no such file", file=sys.stderr)
        return 2
    from engine_service.batch_backends import BackendUnavailable

    try:
        check_input(args.input)  # refuse duplicates before loading a model
        backend, model_name = make_backend(args)
        summary = run_job(args.input, args.output, backend, progress=not args.no_progress, model_name=model_name)
    except DuplicateIds as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BackendUnavailable as e:
        print(f"error: {e}; the rows finished so far are in {args.output}, run again to resume", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: the rows finished so far are in {args.output}; run the same command again to resume",
              file=sys.stderr)
        return 130
    print(summary.line(args.output), file=sys.stderr)
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(asdict(summary), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
