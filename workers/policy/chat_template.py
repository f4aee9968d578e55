"""Token bookkeeping for token-in/token-out episodes, with the model's own chat template.

The runner keeps each episode's token ids itself. The first prompt is the chat
template rendered (with the generation prompt) and tokenized. After that the
sequence only grows by appending: the sampled ids exactly as the server returned
them, then the ids of each observation turn. Sampled text is never tokenized
again; it may have been sampled as a tokenization the tokenizer would never
produce, and training must see the ids that were actually sampled.

Observation ids come from rendering two conversations to *text* (the history
ending with the assistant turn, and the history plus the new messages with the
generation prompt) and tokenizing only what the second adds after the end-of-turn
token of that assistant turn. Because the end-of-turn token is a special token,
no BPE merge crosses it, so these ids are exactly the ones a full render would
have at those positions.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workers.errors import WorkerError

logger = logging.getLogger(__name__)

_PROBE_USER = "FORKYARD-PROBE-USER"
_PROBE_ASSISTANT = "FORKYARD-PROBE-ASSISTANT"


class ChatTemplateError(WorkerError):
    """A tokenizer cannot be loaded, or its chat template cannot be extended turn by turn."""


class ChatTokenizer:
    """A model's tokenizer and chat template, for appending turns to an episode's token ids."""

    def __init__(self, model_dir_or_name: str | Path, *, end_of_turn: str | None = None) -> None:
        """Load the tokenizer from local files only (a directory or an already cached model name).

        Args:
            end_of_turn: the token that closes an assistant turn; found from the
                template when not given (``<|im_end|>`` for ChatML models).

        Raises:
            ChatTemplateError: no such local tokenizer, no chat template, or no end-of-turn token.
        """
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:  # pragma: no cover - a dependency of the package
            raise ChatTemplateError("the tokens api needs the 'transformers' package") from exc

        self.name = str(model_dir_or_name)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.name, local_files_only=True)
        except Exception as exc:  # transformers raises OSError, ValueError, EnvironmentError...
            raise ChatTemplateError(
                f"cannot load a tokenizer from {self.name!r} (local files only): {type(exc).__name__}: {exc}"
            ) from exc
        if not getattr(self.tokenizer, "chat_template", None):
            raise ChatTemplateError(f"tokenizer {self.name!r} has no chat template")
        self.end_of_turn = end_of_turn or self._find_end_of_turn()
        eot_id = self.tokenizer.convert_tokens_to_ids(self.end_of_turn)
        if not isinstance(eot_id, int) or eot_id == self.tokenizer.unk_token_id or eot_id is None:
            raise ChatTemplateError(f"end-of-turn token {self.end_of_turn!r} is not in the vocabulary of {self.name!r}")
        self.end_of_turn_id: int = eot_id
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids: frozenset[int] = frozenset({eot_id} | ({eos} if isinstance(eos, int) else set()))
        self._special_ids = frozenset(self.tokenizer.all_special_ids)

    def _find_end_of_turn(self) -> str:
        """Return the special token the template puts right after an assistant message."""
        text = self.render(
            [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}],
            None,
            add_generation_prompt=False,
        )
        at = text.rfind(_PROBE_ASSISTANT)
        if at != -1:
            tail = text[at + len(_PROBE_ASSISTANT) :]
            ids = self.encode(tail)
            special = set(self.tokenizer.all_special_ids)
            if ids and ids[0] in special:
                return self.tokenizer.convert_ids_to_tokens(ids[0])
        eos = self.tokenizer.eos_token
        if isinstance(eos, str) and eos:
            return eos
        raise ChatTemplateError(
            f"cannot tell the end-of-turn token of {self.name!r}: the template puts no special token after an "
            "assistant message and the tokenizer has no eos token; pass end_of_turn"
        )

    # ------------------------------------------------------------------ primitives

    def render(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, *,
               add_generation_prompt: bool) -> str:
        """Return the chat template rendered to text."""
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except Exception as exc:  # jinja2 errors, template raise_exception(...)
            raise ChatTemplateError(
                f"the chat template of {self.name!r} failed to render: {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(text, str):
            raise ChatTemplateError(f"the chat template of {self.name!r} rendered {type(text).__name__}, not text")
        return text

    def encode(self, text: str) -> list[int]:
        """Tokenize ``text`` as it sits inside a conversation (no BOS/EOS added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Return the text of ``ids`` (special tokens kept unless asked otherwise)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def ends_turn(self, ids: Sequence[int]) -> bool:
        """Tell whether sampled ``ids`` end with the end-of-turn (or eos) token."""
        return bool(ids) and ids[-1] in self.eos_token_ids

    # ------------------------------------------------------------------ episode bookkeeping

    def initial_prompt_ids(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> list[int]:
        """Return the ids of the first prompt: the template with the generation prompt, tokenized."""
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def observation_ids(
        self,
        history_messages: Sequence[dict[str, Any]],
        new_messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None,
        *,
        completion_ended: bool,
    ) -> list[int]:
        """Return the ids to append after a sampled completion: the new turns plus the next generation prompt.

        Args:
            history_messages: the conversation so far, ending with the assistant
                message of the completion just sampled (its text only steers the
                template; its ids are never recomputed).
            new_messages: the tool/user messages that follow it.
            completion_ended: whether the sampled ids already end with the
                end-of-turn token; if not, it is prepended so the turn is closed.

        Raises:
            ChatTemplateError: the history does not end with an assistant message,
                or the template renders the history differently once the new turns
                follow it (such a template cannot be extended token by token).
        """
        if not history_messages or history_messages[-1].get("role") != "assistant":
            raise ChatTemplateError("observation_ids needs a history that ends with the assistant's message")
        if not new_messages:
            raise ChatTemplateError("observation_ids needs at least one new message")
        before = self.render(history_messages, tools, add_generation_prompt=False)
        after = self.render([*history_messages, *new_messages], tools, add_generation_prompt=True)
        cut = before.rfind(self.end_of_turn)
        if cut == -1:
            raise ChatTemplateError(
                f"the chat template of {self.name!r} does not close the assistant turn with {self.end_of_turn!r}"
            )
        cut += len(self.end_of_turn)
        if not after.startswith(before[:cut]):
            raise ChatTemplateError(
                f"the chat template of {self.name!r} renders the earlier turns differently once new turns follow "
                "them, so the episode's tokens cannot be extended turn by turn"
            )
        ids = self.encode(after[cut:])
        return ids if completion_ended else [self.end_of_turn_id, *ids]


@functools.lru_cache(maxsize=8)
def load_chat_tokenizer(model_dir_or_name: str) -> ChatTokenizer:
    """Return a shared :class:`ChatTokenizer` for ``model_dir_or_name`` (loaded once per process)."""
    return ChatTokenizer(model_dir_or_name)


__all__ = ["ChatTemplateError", "ChatTokenizer", "load_chat_tokenizer"]
