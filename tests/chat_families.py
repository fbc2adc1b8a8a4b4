"""The chat-template families people train, as test data: each family's template
(tests/unit/data/chat_templates, its source named in its header) and a tokenizer built
here with the family's special tokens (no hub: a byte-level BPE trained on a few lines),
the tool parser vLLM serves it with, and how its model writes a call to
`lookup(key="lime")`."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from rlhf_env.protocol import Tool, ToolFunction

TEMPLATES = Path(__file__).parent / "unit" / "data" / "chat_templates"
HEADER = re.compile(r"\A\{#-(?P<header>.*?)-#\}\n", re.DOTALL)
SHA256 = re.compile(r"sha256 ([0-9a-f]{64})")

LOOKUP = Tool(
    function=ToolFunction(
        name="lookup",
        description="The value of a key.",
        parameters={"type": "object", "properties": {"key": {"type": "string"}}},
    )
)
HERMES_CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": "lime"}}\n</tool_call>'
CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_ADDED = ("<tool_call>", "</tool_call>", "<think>", "</think>")
LLAMA = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
)
MISTRAL = (
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
)
GEMMA = ("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>")
CORPUS = [
    "What is the value of the key 'lime'? The value is green. I should look it up.",
    HERMES_CALL,
    '{"name": "lookup", "parameters": {"key": "lime"}}',
    '[lookup(key="lime")] [TOOL_CALLS] [{"name": "lookup", "arguments": {"key": "lime"}}]',
    "You are a helpful assistant. Today Date: 26 Jul 2024. Cutting Knowledge Date",
]


@dataclass(frozen=True)
class Family:
    template: str  # its file, without .jinja
    parser: str  # vLLM's tool parser for it (vllm serve --tool-call-parser)
    special: tuple[str, ...]
    bos: str | None
    eos: str
    end_of_turn: str  # what ChatRenderer must read from the template
    call: str  # the model's turn that calls lookup(key="lime")
    answer: str = "green"  # its last turn
    pad: str | None = None
    added: tuple[str, ...] = ()  # tokens that are not special (Qwen's <tool_call>)
    kwargs: Mapping[str, bool | int | float | str] = field(default_factory=dict)
    call_stop: str | None = None  # the token its call turn stopped on, if not end_of_turn
    after_last_turn: str = ""  # the template's glue after the conversation's last turn
    calls_as_content: bool = False  # a template that renders no tool calls, only content

    @property
    def name(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in self.kwargs.items())
        stop = f",stops on {self.call_stop}" if self.call_stop else ""
        return f"{self.template}({extra}{stop})" if extra or stop else self.template


def qwen(**overrides: Any) -> Family:
    base: dict[str, Any] = dict(
        template="qwen3",
        parser="hermes",
        special=CHATML,
        bos=None,
        eos="<|im_end|>",
        end_of_turn="<|im_end|>",
        call=HERMES_CALL,
        pad="<|endoftext|>",
        added=QWEN_ADDED,
        after_last_turn="\n",
    )
    return Family(**{**base, **overrides})


def llama(template: str) -> Family:
    # EOS is the base model's <|end_of_text|>: the end of a turn comes from the template.
    call = '{"name": "lookup", "parameters": {"key": "lime"}}'
    return Family(template, "llama3_json", LLAMA, "<|begin_of_text|>", "<|end_of_text|>",
                  "<|eot_id|>", call)  # fmt: skip


FAMILIES = [
    qwen(  # thinking on: the model opens its <think> block itself
        call="<think>\nI should look it up.\n</think>\n\n" + HERMES_CALL,
        answer="<think>\nIt said green.\n</think>\n\ngreen",
    ),
    qwen(kwargs={"enable_thinking": False}),
    qwen(template="qwen2_5", call_stop="<|endoftext|>"),
    llama("llama3_1"),
    llama("llama3_2"),
    Family(
        "mistral_v0_3",
        "mistral",
        MISTRAL,
        "<s>",
        "</s>",
        "</s>",
        call='[TOOL_CALLS] [{"name": "lookup", "arguments": {"key": "lime"}, "id": "abcDEF123"}]',
        answer=" green",
    ),
    Family(
        "gemma3_pythonic",
        "pythonic",
        GEMMA,
        "<bos>",
        "<eos>",
        "<end_of_turn>",
        call='[lookup(key="lime")]',
        pad="<pad>",
        after_last_turn="\n",
    ),
    qwen(template="smollm2", added=(), calls_as_content=True),
]


def template_text(name: str) -> str:
    """The template as its source has it, without the header that names the source."""
    text = (TEMPLATES / f"{name}.jinja").read_text()
    header = HEADER.match(text)
    assert header is not None, f"{name}.jinja: no header naming its source"
    return text[header.end() :]


def recorded_sha256(name: str) -> str:
    header = HEADER.match((TEMPLATES / f"{name}.jinja").read_text())
    assert header is not None
    found = SHA256.search(header["header"])
    assert found is not None, f"{name}.jinja: its header records no sha256"
    return found[1]


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def tokenizer_of(family: Family) -> Any:
    """A byte-level BPE with the family's special tokens, its BOS, EOS and pad."""
    return _tokenizer(family.special, family.bos, family.eos, family.pad, family.added)


@cache
def _tokenizer(
    special: tuple[str, ...], bos: str | None, eos: str, pad: str | None, added: tuple[str, ...]
) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=bos, eos_token=eos, pad_token=pad
    )
    tokenizer.add_tokens(list(added))
    return tokenizer
