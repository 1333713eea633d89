"""xgrammar vs llguidance on the bundled tokenizer: grammar compile time and per-step mask cost.

    python bench/structured_backends.py                 # both libraries, batch of 16 constrained rows
    python bench/structured_backends.py --batch 64 --steps 48

For each library and each grammar kind (JSON schema, regex, choice, EBNF grammar), in one run:
- compile: wall time to turn the grammar text into something a matcher can use (first time, no
  cache; the vocabulary preprocessing that is done once per tokenizer is timed separately);
- per decode step for ``--batch`` constrained rows (medians): fill the [B, V/32] bitmask, apply it
  to [B, V] float32 logits (+ argmax), advance every matcher by its chosen token. Tokens are
  the argmax of random logits under the mask (a stand-in for the model), so the rows walk through
  real grammar states; a row that terminates is reset (``resets`` counts them).
Nothing here needs the model weights, only its tokenizer. Neither library is required: a missing
one is reported and skipped.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]},
    },
    "required": ["name", "age", "role", "tags", "address"],
}
REGEX = r"[A-Z][a-z]{2,8} [0-9]{1,3}(\.[0-9]{1,2})?"
CHOICE = ["positive", "negative", "neutral", "mixed feelings"]
EBNF = 'root ::= "(" expr ")"\nexpr ::= term (("+" | "*") term)*\nterm ::= [0-9]+ | "(" expr ")"'


def load_tokenizer():
    from engine_service.model_loader import load_tokenizer as load, resolve_model_dir

    return load(resolve_model_dir("bundled"))


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar as xgr

        self.xgr = xgr
        t = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.setup_s = time.perf_counter() - t
        self.batch_matcher = xgr.BatchGrammarMatcher(max_threads=2)

    def compile(self, kind: str, spec):
        c = self.compiler
        if kind == "json":
            return c.compile_json_schema(json.dumps(spec))
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            return c.compile_regex("|".join(_escape(s) for s in spec))
        return c.compile_grammar(spec)

    def matchers(self, compiled, n: int):
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def allocate(self, batch: int, vocab_size: int):
        return self.xgr.allocate_token_bitmask(batch, vocab_size)

    def fill(self, matchers, bitmask):
        self.batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask)

    def apply(self, logits, bitmask):
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)

    def advance(self, matcher, token: int) -> bool:
        """Accept token; True when the matcher must be reset (terminated or stuck)."""
        ok = matcher.accept_token(token)
        return not ok or matcher.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        t = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.setup_s = time.perf_counter() - t
        self.executor = llguidance.LLExecutor(num_threads=2)

    def compile(self, kind: str, spec):
        llg = self.llg
        if kind == "json":
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(spec))
        elif kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(spec)
        elif kind == "choice":
            grammar = llg.grammar_from("choice", json.dumps(spec))
        else:
            grammar = llg.grammar_from("gbnf", spec)
        # llguidance compiles lazily; building one matcher is where the cost lands.
        matcher = llg.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matchers(self, grammar, n: int):
        return [self.llg.LLMatcher(self.tokenizer, grammar) for _ in range(n)]

    def allocate(self, batch: int, vocab_size: int):
        return self.llg.torch.allocate_token_bitmask(batch, vocab_size)

    def fill(self, matchers, bitmask):
        self.llg.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def apply(self, logits, bitmask):
        self.llg.torch.apply_token_bitmask_inplace(logits, bitmask)

    def advance(self, matcher, token: int) -> bool:
        ok = matcher.consume_token(token)
        return not ok or matcher.is_stopped() or matcher.is_error()


def _escape(s: str) -> str:
    import re

    return re.escape(s)


def measure(backend, kind: str, spec, batch: int, steps: int, vocab_size: int) -> dict:
    t = time.perf_counter()
    compiled = backend.compile(kind, spec)
    compile_s = time.perf_counter() - t
    matchers = backend.matchers(compiled, batch)
    bitmask = backend.allocate(batch, vocab_size)
    gen = torch.Generator().manual_seed(0)
    fill, apply, advance = [], [], []
    resets = 0
    for _ in range(steps):
        logits = torch.randn(batch, vocab_size, generator=gen)
        t0 = time.perf_counter()
        backend.fill(matchers, bitmask)
        t1 = time.perf_counter()
        backend.apply(logits, bitmask)
        tokens = logits.argmax(-1).tolist()
        t2 = time.perf_counter()
        for i, (m, tok) in enumerate(zip(matchers, tokens)):
            if backend.advance(m, tok):
                m.reset()
                resets += 1
        t3 = time.perf_counter()
        fill.append(t1 - t0)
        apply.append(t2 - t1)
        advance.append(t3 - t2)
    ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    return {"compile_ms": compile_s * 1e3, "fill_ms": ms(fill), "apply_ms": ms(apply), "advance_ms": ms(advance),
            "resets": resets}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--vocab-size", type=int, default=49152)
    args = ap.parse_args()
    torch.set_num_threads(2)
    tokenizer = load_tokenizer()
    print(f"batch {args.batch} constrained rows, {args.steps} steps, vocab {args.vocab_size}")
    print("| library | vocab setup ms | grammar | compile ms | fill ms | apply+argmax ms | advance ms | resets |")
    print("|---|---|---|---|---|---|---|---|")
    kinds = {"json": SCHEMA, "regex": REGEX, "choice": CHOICE, "grammar": EBNF}
    for cls in (XGrammar, LLGuidance):
        try:
            backend = cls(tokenizer, args.vocab_size)
        except ImportError as e:
            print(f"| {cls.name} | not installed ({e}) |")
            continue
        for kind, spec in kinds.items():
            r = measure(backend, kind, spec, args.batch, args.steps, args.vocab_size)
            print(f"| {backend.name} | {backend.setup_s * 1e3:.0f} | {kind} | {r['compile_ms']:.1f} | "
                  f"{r['fill_ms']:.2f} | {r['apply_ms']:.2f} | {r['advance_ms']:.2f} | {r['resets']} |", flush=True)


if __name__ == "__main__":
    main()
