"""Chat messages as prompt tokens, through the model's own chat template.

A model's template is its tokenizer's (`chat_template`, applied by transformers'
`apply_chat_template` with the generation prompt); the built-in models, whose tokenizer files
carry none, get BUILTIN_TEMPLATE here, in their own `<|im_start|>` format. A model with no
template is a 400 saying so: guessing a format would evaluate the model on a prompt it never
saw. A chat turn ends at the template's end-of-turn token as well as at EOS.

Not here: sampling (service/openai/completions.py), the wire (api/openai/).

Imports: config, errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from posttrain.config import BUILTIN_MODELS
from posttrain.errors import InvalidRequest

# ChatML, the format the built-in models' special tokens come from (Qwen's).
BUILTIN_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
END_OF_TURN = "<|im_end|>"


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation to continue as the assistant."""

    messages: tuple[ChatMessage, ...]


def chat_template(tokenizer: PreTrainedTokenizerBase, base_model: str) -> str:
    own: str | None = tokenizer.chat_template  # transformers declares the attribute untyped
    if own:
        return own
    if base_model in BUILTIN_MODELS:
        return BUILTIN_TEMPLATE
    raise InvalidRequest(
        f"model {base_model} has no chat template (its tokenizer defines none); use"
        " /v1/completions with a prompt in the model's own format",
        param="messages",
    )


def chat_tokens(
    tokenizer: PreTrainedTokenizerBase, base_model: str, prompt: ChatPrompt
) -> tuple[int, ...]:
    """The conversation through the model's template, ending in the assistant's turn."""
    messages = [{"role": m.role, "content": m.content} for m in prompt.messages]
    rendered = tokenizer.apply_chat_template(
        messages,
        chat_template=chat_template(tokenizer, base_model),
        add_generation_prompt=True,
        tokenize=False,
    )
    assert isinstance(rendered, str), "apply_chat_template(tokenize=False) renders text"
    return tuple(tokenizer.encode(rendered, add_special_tokens=False))


def end_of_turn_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The template's end-of-turn token, where the tokenizer has it as a token of its own."""
    token_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
        return ()
    return (token_id,)
