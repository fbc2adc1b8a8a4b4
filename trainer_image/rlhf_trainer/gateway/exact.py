"""Token-exact prompts for calls that continue an episode's conversation.

An agent sends its whole history with every call, as text: the assistant's earlier turns
come back as the content the gateway returned. The chat template renders that text and
vLLM tokenises it again, and a BPE tokeniser need not give the ids the engine sampled
("gr" + "een" comes back as "green"). The call's prompt would then no longer extend the
earlier call's ids, and the trainer would see another sample, with the earlier turn's
tokens re-tokenised into its (masked) prompt.

So before a call reaches the engine its prompt is rebuilt where the text allows: when
the rendered text starts with an earlier call's prompt text followed by the text of what
that call sampled (special tokens included: the end of turn the engine sampled), the
prompt is that call's ids, then its sampled ids, then only the rest of the text encoded
(the template's glue, the new tool and user messages, the generation prompt), as
rollout/chat_template.py's ChatRenderer appends an environment's messages. The engine
samples from those ids, and the ids are what is recorded: the call extends the earlier
one by construction. Where the text does not line up (the agent edited its history,
or the template rewrote the turn: reasoning dropped, tool calls re-serialised), the
template's rendering stands and the call becomes a sample of its own (merge.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REPLACEMENT = "\ufffd"  # what decoding puts for bytes that are no whole character


@dataclass(frozen=True)
class Context:
    """What one earlier choice left: the text the template would render for it, and its ids."""

    text: str  # the call's prompt text, then the sampled ids decoded (specials kept; no U+FFFD)
    ids: list[int]  # (P + n,) the call's prompt ids, then the sampled ids


class Contexts:
    """The contexts of each open episode's calls, by key. `tokenizer` is the engine's."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._by_key: dict[str, list[Context]] = {}

    def open(self, key: str) -> None:
        self._by_key[key] = []

    def close(self, key: str) -> None:
        self._by_key.pop(key, None)

    def add(
        self, key: str, prompt_text: str | None, prompt_ids: list[int], sampled: list[int]
    ) -> None:
        contexts = self._by_key.get(key)
        if contexts is None or prompt_text is None or not sampled:
            return
        sampled_text = self._tokenizer.decode(
            sampled, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        text = _whole_characters(prompt_text + sampled_text)
        contexts.append(Context(text, [*prompt_ids, *sampled]))

    def prompt_ids(self, key: str, text: str, ids: list[int]) -> list[int]:
        """The ids to sample the call rendered as `text` (tokenised as `ids`) from: those
        of the longest earlier context whose text it continues, then the rest encoded;
        else `ids` as vLLM tokenised them."""
        whole = _whole_characters(text)
        fits = [c for c in self._by_key.get(key, ()) if whole.startswith(c.text)]
        if not fits:
            return ids
        context = max(fits, key=lambda c: len(c.text))
        rest = text[_position(text, len(context.text)) :]
        return [*context.ids, *self._tokenizer.encode(rest, add_special_tokens=False)]


def _whole_characters(text: str) -> str:
    """`text` without U+FFFD: bytes that are no whole character decode as it, and vLLM's
    streaming detokenizer and a whole decode do not always put it in the same places (a
    turn cut mid-character: vLLM holds the bytes back, and the agent never sees them)."""
    return text.replace(REPLACEMENT, "")


def _position(text: str, characters: int) -> int:
    """Where in `text` its first `characters` characters other than U+FFFD end, and any
    U+FFFD right after them (the context's own cut bytes)."""
    seen = 0
    for index, character in enumerate(text):
        if character == REPLACEMENT:
            continue
        if seen == characters:
            return index
        seen += 1
    return len(text)
