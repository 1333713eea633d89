"""The router's tokenizer: the engine's own tokenizer files, run with the `tokenizers` library and
the chat template rendered with jinja2 the way transformers renders it.

The router tokenizes every prompt once: to check its length against ``max_model_len`` before it
queues, to count the KV room it needs for admission, and to forward token ids so that the engine
does not tokenize again. It avoids importing transformers (seconds of start-up, hundreds of MB)
for that; tests check that the ids equal the engine's.
"""
from __future__ import annotations

import json
import os
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class PromptTokenizer:
    """Encodes prompts and chat conversations exactly as the engine serving the model does."""

    def __init__(self, files: dict[str, str]):
        self._tokenizer = Tokenizer.from_str(files["tokenizer.json"])
        config = json.loads(files.get("tokenizer_config.json") or "{}")
        template = files.get("chat_template.jinja") or config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template = template
        self.special_tokens = {name: _token_text(config.get(name)) for name in
                               ("bos_token", "eos_token", "unk_token", "pad_token")}
        self._template = None
        if template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, sort_keys=False: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(template)

    @classmethod
    def from_dir(cls, model_dir: str) -> "PromptTokenizer":
        from router.registry import read_tokenizer_files

        return cls(read_tokenizer_files(os.path.expanduser(model_dir)))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the conversation rendered with the model's chat template (ValueError if it has none)."""
        if self._template is None:
            raise ValueError("messages: this model has no chat template; send prompt or prompt_token_ids")
        try:
            text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"messages: the chat template refused the conversation: {e}") from e
        return self.encode(text, add_special_tokens=False)
