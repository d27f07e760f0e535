"""Chat messages -> prompt text, with the model's own Jinja chat template.

The template is the `chat_template` of the engine's `tokenizer_config.json` (Hugging Face's
format; `build.engine` copies the checkpoint's), rendered the way transformers renders it:
a sandboxed Jinja environment with `trim_blocks`/`lstrip_blocks`, the variables `messages`
(`{"role", "content"}` dicts), `add_generation_prompt` (true), `bos_token`, `eos_token`, and
`raise_exception(message)` for templates that refuse a conversation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from triton_repo.openai.protocol import APIError, bad_request

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
"""`runtime.engine_dir.TOKENIZER_CONFIG_FILE`, spelled out: this front end does not import
torch (which `runtime.engine_dir` does)."""


class TemplateRefusal(Exception):
    """Raised by a template's `raise_exception(...)`."""


def _raise(message: str) -> NoReturn:
    raise TemplateRefusal(message)


def _token(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or `{"content": ...}`."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


@dataclass
class ChatTemplate:
    template: Template
    bos_token: str = ""
    eos_token: str = ""

    @classmethod
    def from_source(cls, source: str, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        return cls(env.from_string(source), bos_token, eos_token)

    @classmethod
    def from_tokenizer_config(cls, path: Path) -> ChatTemplate | None:
        """The template of a tokenizer_config.json; None if it has none (or is missing)."""
        if not path.is_file():
            return None
        doc = json.loads(path.read_text())
        source = doc.get("chat_template")
        if isinstance(source, list):  # Hugging Face's named templates: use "default"
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not source:
            return None
        return cls.from_source(source, _token(doc.get("bos_token")), _token(doc.get("eos_token")))

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt for `messages`; APIError (400) when the template refuses them."""
        try:
            return self.template.render(
                messages=messages, add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token
            )
        except TemplateRefusal as e:
            raise bad_request(f"messages: {e}", "messages") from None
        except TemplateError as e:
            raise bad_request(f"messages: the model's chat template failed on them ({e})", "messages") from None


def no_template(model: str) -> APIError:
    return bad_request(
        f"model {model!r} has no chat template (no chat_template in its engine's {TOKENIZER_CONFIG_FILE}): "
        "use /v1/completions, rebuild the engine from a checkpoint whose tokenizer_config.json has one, "
        "or start the server with --chat-template FILE",
        "messages",
    )
