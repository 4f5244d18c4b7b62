"""Chat messages → prompt text: the tokenizer's own Jinja `chat_template`, rendered as `transformers` does.

`transformers`' `apply_chat_template(messages, add_generation_prompt=True, tokenize=False)` compiles the template in
jinja2's `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the loop-controls extension, a
`tojson` filter that does not escape HTML, the globals `raise_exception` and `strftime_now`, and renders it with
`messages`, `add_generation_prompt`, `tools=None`, `documents=None` and the tokenizer's named special tokens
(`bos_token`, `eos_token`, ...) as strings. `ChatTemplate` does the same, so prompts are byte-for-byte those the
model saw in `transformers`. Tokenizers without a template use `render_builtin_chat`, a fixed `<|role|>` format.

jinja2 itself (`chat_jinja`) is imported with the first template compiled: a process whose tokenizer has none (the
tiny recipe's) never pays its ~0.16 CPU-seconds of imports, where before every worker did.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# transformers' `SPECIAL_TOKENS_ATTRIBUTES`: the names a template may use for the tokenizer's special tokens.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
BUILTIN_FORMAT = "<|role|>"


def render_builtin_chat(messages: list[dict[str, Any]]) -> str:
    """Chat messages → "<|{role}|>\\n{content}\\n" per message, then "<|assistant|>\\n".

    A fixed, model-agnostic format, used only for tokenizers without a `chat_template` (the tiny recipe's).
    """
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


class TemplateRefused(ValueError):
    """The template refused the messages: its `raise_exception`, or any other error jinja2 raised rendering them."""


class ChatTemplate:
    """A tokenizer's Jinja chat template with the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str], origin: str) -> None:
        self.source = source
        self.special_tokens = special_tokens
        self.origin = origin  # the file the template came from, for messages
        from megatron_ppo.data import chat_jinja

        self._template = chat_jinja.compile_template(source, origin)
        self._refusal = chat_jinja.REFUSAL

    def render(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text for `messages`, ending with the template's generation prompt (the assistant's header).

        Raises `TemplateRefused` when the template refuses the messages (its `raise_exception`)."""
        try:
            return self._template.render(
                messages=messages, tools=None, documents=None, add_generation_prompt=True, **self.special_tokens
            )
        except self._refusal as e:
            raise TemplateRefused(str(e)) from e


def load_chat_template(directory: Path, tokenizer_config: dict[str, Any]) -> ChatTemplate | None:
    """The template of a Hugging Face tokenizer directory, as `transformers` finds it: `chat_template.jinja` beside
    the tokenizer first, else `tokenizer_config.json`'s `chat_template` (a string, or a list of named templates of
    which "default" is used). None when there is none."""
    special_tokens = {
        name: text for name in SPECIAL_TOKEN_NAMES if (text := token_text(tokenizer_config.get(name))) is not None
    }
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(encoding="utf-8"), special_tokens, str(jinja_file))
    origin = str(directory / "tokenizer_config.json")
    template = tokenizer_config.get("chat_template")
    if template is None:
        return None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(
                f"{origin}: chat_template lists templates {sorted(map(str, named))} but none named 'default'; "
                "name the one prompts are rendered with 'default'"
            )
        template = named["default"]
    if not isinstance(template, str):
        raise ValueError(f"{origin}: chat_template is a {type(template).__name__}; expected a Jinja string")
    return ChatTemplate(template, special_tokens, origin)


def token_text(token: str | dict[str, Any] | None) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken object with its "content"."""
    return token.get("content") if isinstance(token, dict) else token
