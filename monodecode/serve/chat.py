"""Chat messages -> prompt text.

With the checkpoint's `tokenizer_config.json` holding a `chat_template` (a Jinja string, or a
list of named templates, "default" first), that template renders the messages as transformers
does (`messages`, `add_generation_prompt=True`, `bos_token`, `eos_token`), and the text is
encoded without adding special tokens (the template writes them). Otherwise the plain default:
one line `role: content` a message, then `assistant:`, encoded like a completion prompt.
"""

from __future__ import annotations

import json
from pathlib import Path


class ChatTemplate:
    def __init__(self, source=None):
        """`source`: the checkpoint directory or preset name."""
        config = _tokenizer_config(source)
        template = config.get("chat_template")
        if isinstance(template, list):
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        self.source = template
        self.special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}
        self._compiled = None
        if template is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            self._compiled = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)

    @property
    def adds_special_tokens(self) -> bool:
        """Whether the prompt's encoding should add the tokenizer's special tokens itself."""
        return self._compiled is None

    def render(self, messages: list[dict]) -> str:
        messages = [{**m, "content": message_text(m)} for m in messages]
        if self._compiled is not None:
            return self._compiled.render(messages=messages, add_generation_prompt=True, **self.special)
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def message_text(message: dict) -> str:
    """A message's content: a string, or the text of a list of content parts."""
    content = message.get("content") or ""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def _tokenizer_config(source) -> dict:
    path = Path(str(source)) / "tokenizer_config.json" if source is not None else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else {}


def _token_text(token) -> str:
    return token.get("content", "") if isinstance(token, dict) else (token or "")
