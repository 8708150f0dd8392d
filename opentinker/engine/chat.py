"""Chat-template token ids for multi-turn rollouts, built incrementally.

A multi-turn response is the model's tokens exactly as sampled, interleaved with
environment turns. An environment turn is tokenized as the *increment* the chat template
adds for one more message (never a re-render of the conversation, which would repeat the
system prompt and could re-tokenize the model's text differently).
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from opentinker.engine.data import chat_prompt_ids, render_chat_ids

# A throwaway exchange: what the template adds after it is the increment for a new turn.
_PROBE = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": "probe"}]


class ChatTemplater:
    """Prompt ids for a conversation and the ids one more (environment) turn appends.

    ``end_of_turn_ids`` are the tokens the template puts after the model's end-of-turn
    token (e.g. the newline after ``<|im_end|>``); they belong to the environment's increment
    because the model stops at its end-of-turn token.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self._probe_ids = render_chat_ids(tokenizer, _PROBE, add_generation_prompt=False)
        last_eos = max((i for i, t in enumerate(self._probe_ids) if t in self.eos_token_ids), default=None)
        if last_eos is None:
            raise ValueError("the chat template does not end an assistant turn with an end-of-sequence token")
        self.turn_end_id = self._probe_ids[last_eos]
        self.end_of_turn_ids = self._probe_ids[last_eos + 1 :]

    def prompt_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    def turn_ids(self, text: str, role: str = "user", model_turn_ended: bool = True) -> list[int]:
        """Ids appended after a model turn for a new ``role`` message, then the assistant prompt.

        ``model_turn_ended`` is False when the model was cut off before its end-of-turn token;
        the template's end-of-turn token is then supplied here (as an environment token).
        """
        full = render_chat_ids(self.tokenizer, [*_PROBE, {"role": role, "content": text}], add_generation_prompt=True)
        if full[: len(self._probe_ids)] != self._probe_ids:
            raise ValueError("the chat template re-renders earlier turns when a message is added; "
                             "incremental multi-turn tokenization needs an append-only template")
        closing = ([] if model_turn_ended else [self.turn_end_id]) + self.end_of_turn_ids
        return closing + full[len(self._probe_ids) :]
