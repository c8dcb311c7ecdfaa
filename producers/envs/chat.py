"""The text side of text environments: chat-formatted prompts and observation turns as token ids.

`Chat` wraps any tokenizer with the HF calls `apply_chat_template(..., tokenize=False)`,
`encode(text, add_special_tokens=False)` and `decode(ids)`. It reads the template once, with
sentinel messages, to learn how an assistant turn ends and how a user turn plus the next assistant
header look, so an observation can be appended right after the model's own stop token without
re-tokenizing what the model sampled.

`ByteTokenizer` (schemas/tokenizers.py) is a ChatML tokenizer over raw UTF-8 bytes for tiny models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_ACT, _OBS = "\x00SAO-ACTION\x00", "\x00SAO-OBSERVATION\x00"


class Chat:
    """Chat-formatted token ids for one tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        user = {"role": "user", "content": "U"}
        acted = tokenizer.apply_chat_template([user, {"role": "assistant", "content": _ACT}], tokenize=False)
        both = tokenizer.apply_chat_template(
            [user, {"role": "assistant", "content": _ACT}, {"role": "user", "content": _OBS}],
            add_generation_prompt=True, tokenize=False)
        if not both.startswith(acted) or _OBS not in both:
            raise ValueError("the tokenizer's chat template does not render turns as a prefix-stable "
                             "sequence; text environments cannot append observations to it")
        self.turn_end = acted.split(_ACT, 1)[1]  # e.g. "<|im_end|>\n"
        self.next_turn = both[len(acted):]  # e.g. "<|im_start|>user\n{obs}<|im_end|>\n<|im_start|>assistant\n"

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The conversation so far, ending with the assistant header the model continues from."""
        return self.encode(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                              tokenize=False))

    def observation_ids(self, action_ids: Sequence[int], text: str) -> list[int]:
        """Tokens that close the model's turn (unless its stop token already did), add `text` as a
        user turn, and open the next assistant turn."""
        return self.encode(self.closing(action_ids) + self.next_turn.replace(_OBS, text))

    def closing(self, action_ids: Sequence[int]) -> str:
        """What the template adds after the model's turn `action_ids` to end it: `turn_end`, less
        the stop token the model already sampled."""
        if action_ids and action_ids[-1] in self.stop_token_ids():
            return self.turn_end.removeprefix(self.tokenizer.decode([action_ids[-1]]))
        return self.turn_end

    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end an assistant turn: the template's end-of-turn token and the EOS."""
        ids = {self.tokenizer.eos_token_id}
        end = self.encode(self.turn_end.strip())
        if len(end) == 1:
            ids.add(end[0])
        return tuple(sorted(i for i in ids if i is not None))


@dataclass(kw_only=True)
class ChatEnv:
    """The part every environment that talks to the policy through its chat template shares: the
    policy's tokenizer, and the `Chat` built from it once. The feeder and the evaluator's task
    split make environments without one (they only sample tasks); episodes need it."""

    tokenizer: Any = None
    """Tokenizer of the policy; only `episode` needs it (the feeder samples tasks without one)."""
    _chat: Chat | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        self._chat = Chat(self.tokenizer) if self.tokenizer is not None else None

    def episode_chat(self, **needed: Any) -> Chat:
        """The chat, for an episode; ValueError naming whatever it lacks (the tokenizer, or one of
        `needed`, such as a sandbox)."""
        missing = (["a tokenizer"] if self._chat is None else []) + [f"a {k}" for k, v in needed.items() if v is None]
        if missing:
            raise ValueError(f"{getattr(self, 'name', type(self).__name__)} needs {' and '.join(missing)} "
                             "to run episodes")
        return self._chat
