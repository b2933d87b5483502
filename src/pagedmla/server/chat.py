"""Chat messages -> prompt text: the checkpoint's jinja2 chat template, rendered as
Hugging Face transformers renders it, or DeepSeek-V3.2's message encoding, which that
model ships as Python instead of a template.

A template comes from `chat_template.jinja` in the checkpoint directory, else from the
`chat_template` field of `tokenizer_config.json` (a string, or a list of named
templates of which "default" is taken). The rendered text carries its own special
tokens (BOS included), so it is encoded without adding them again.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = Mapping[str, Any]
ChatRenderer = Callable[[Sequence[Message], bool], str]

# DeepSeek-V3.2's special tokens (its tokenizer.json), in the chat encoding its
# repository documents: non-thinking replies open with an empty reasoning span.
_DSV32_BOS = "<｜begin▁of▁sentence｜>"
_DSV32_EOS = "<｜end▁of▁sentence｜>"
_DSV32_USER = "<｜User｜>"
_DSV32_ASSISTANT = "<｜Assistant｜>"
_DSV32_NO_THINKING = "</think>"


def message_text(message: Message, index: int) -> str:
    """The text of messages[index]: its `content`, a str or a list of text parts."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ValueError(f"messages[{index}].content: only text parts are supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ValueError(f"messages[{index}].content must be a string or a list of text parts")


def _token_text(value: object) -> str:
    """A special token of tokenizer_config.json: a str or an AddedToken's dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def template_renderer(template: str, special_tokens: Mapping[str, str]) -> ChatRenderer:
    """A renderer of the jinja2 `template`, with the environment transformers gives
    chat templates (sandboxed, trim_blocks and lstrip_blocks, loop controls,
    `raise_exception`, `strftime_now`, `tojson` keeping non-ASCII text) and the
    tokenizer's special tokens (`bos_token`, `eos_token`, ...) as variables."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False,
                                                                  indent=indent)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    compiled = env.from_string(template)

    def render(messages: Sequence[Message], add_generation_prompt: bool) -> str:
        plain = [{**m, "content": message_text(m, i)} for i, m in enumerate(messages)]
        try:
            return compiled.render(messages=plain, add_generation_prompt=add_generation_prompt,
                                   **special_tokens)
        except jinja2.exceptions.TemplateError as error:
            raise ValueError(f"the chat template refused the messages: {error}") from error

    return render


def deepseek_v32_render(messages: Sequence[Message], add_generation_prompt: bool) -> str:
    """DeepSeek-V3.2's chat encoding, non-thinking mode: BOS, the system messages' text,
    then each user turn after <｜User｜> and each assistant turn after <｜Assistant｜>
    and an empty reasoning span, closed by EOS."""
    text = [_DSV32_BOS]
    for index, message in enumerate(messages):
        role, content = message.get("role"), message_text(message, index)
        if role == "system":
            text.append(content)
        elif role == "user":
            text.append(_DSV32_USER + content)
        elif role == "assistant":
            text.append(_DSV32_ASSISTANT + _DSV32_NO_THINKING + content + _DSV32_EOS)
        else:
            raise ValueError(f"messages[{index}].role {role!r} is not supported by "
                             "DeepSeek-V3.2's chat encoding (system, user, assistant)")
    if add_generation_prompt:
        text.append(_DSV32_ASSISTANT + _DSV32_NO_THINKING)
    return "".join(text)


def load_chat_renderer(directory: str | Path | None, model_type: str) -> ChatRenderer | None:
    """The chat renderer of a checkpoint directory (None for the built-in model, whose
    package directory is passed in its place), or None when it has none."""
    if directory is None:
        return None
    directory = Path(directory)
    config_path = directory / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
    template: object = None
    if (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    else:
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
    if isinstance(template, str):
        tokens = {key: _token_text(value) for key, value in config.items()
                  if key.endswith("_token")}
        return template_renderer(template, tokens)
    if model_type == "deepseek_v32":
        return deepseek_v32_render
    return None
