"""Token ids between model turns, without re-tokenising what the model sampled.

An episode's ids are the concatenation, in order, of the prompt's ids, each
model turn's ids exactly as the engine returned them, and the ids of what
the environment answered, rendered by the chat template. Earlier turns are
never decoded and tokenised again (a sampled token sequence need not be the
tokenizer's own encoding of its text: trl#5224, verl#3960).

The environment's ids come from the template itself, measured on a fixed
stand-in conversation: ``template(stand-in + messages, generation prompt)``
minus ``template(stand-in)`` gives the messages and the next generation
prompt; the text the template writes after an assistant message (``<|im_end|>\\n``
in ChatML), less the end token the model already sampled, closes the
model's turn. Both are independent of the episode, so they cost one
rendering per reply.

Whether the template would render the whole conversation as exactly these
ids (its *prefix property*) is checked separately (:meth:`TurnTokens.matches_template`):
templates that rewrite earlier turns (dropping reasoning, trimming
whitespace) break it. grpo then keeps the concatenated ids, which are what
the model was conditioned on when it sampled, and counts the episode in
``episodes/template_mismatch``.
"""

from __future__ import annotations

from typing import Any

from grpo_core.contract.types import Messages
from grpo_core.data.prompts import tokenize_prompt

_USER = "grpo-stand-in-user"
_ASSISTANT = "grpo-stand-in-assistant"
STAND_IN: Messages = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]


class TemplateError(ValueError):
    """The chat template cannot render an environment reply after a model turn."""


class TurnTokens:
    """Renders environment messages as the ids that follow a model turn."""

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        closed = self._render(STAND_IN, generation_prompt=False)
        at = closed.rfind(_ASSISTANT)
        if at < 0:
            raise TemplateError("the chat template does not render an assistant message's content")
        self._closed = closed
        self.turn_tail = closed[at + len(_ASSISTANT) :]
        """What the template writes after an assistant message's content."""

    def _render(self, messages: Messages, generation_prompt: bool) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt, **self.kwargs
            )
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def reply_ids(self, messages: Messages, last_model_ids: list[int]) -> list[int]:
        """The ids after a model turn whose ids were ``last_model_ids``: the
        rest of the template's turn ending, ``messages``, then the
        generation prompt of the model's next turn."""
        rendered = self._render([*STAND_IN, *messages], generation_prompt=True)
        return self.encode(self.turn_closing(last_model_ids) + rendered[self._after_stand_in(rendered) :])

    def _after_stand_in(self, rendered: str) -> int:
        """Where the stand-in assistant turn ends in ``rendered``. Usually
        right after its content; a template that rewrites earlier turns may
        have dropped the content, and then the turn ends at the second turn
        ending after the stand-in user's content."""
        if rendered.startswith(self._closed):
            return len(self._closed)
        at = rendered.find(_ASSISTANT)
        if at >= 0:
            start = at + len(_ASSISTANT)
        else:
            user = rendered.find(_USER)
            user_end = rendered.find(self.turn_tail, user + len(_USER)) if user >= 0 else -1
            if user_end < 0:
                raise TemplateError("the chat template renders neither turn of a two-message conversation recognisably")
            start = user_end + len(self.turn_tail)
        end = rendered.find(self.turn_tail, start)
        if end < 0:
            raise TemplateError("the chat template does not close an assistant turn before the next message")
        return end + len(self.turn_tail)

    def turn_closing(self, last_model_ids: list[int]) -> str:
        """The template's turn ending, less the end token the model sampled
        (so a turn cut at the length limit is closed for the model)."""
        if last_model_ids:
            emitted = self.tokenizer.decode(last_model_ids[-1:], skip_special_tokens=False)
            if emitted and self.turn_tail.startswith(emitted) and last_model_ids[-1] in self._special_ids():
                return self.turn_tail[len(emitted) :]
        return self.turn_tail

    def _special_ids(self) -> set[int]:
        return set(getattr(self.tokenizer, "all_special_ids", []) or [])

    def prompt_ids(self, prompt: str | Messages) -> list[int]:
        """Ids of a (re-)started prompt, as the dataset's prompts are made."""
        return tokenize_prompt(prompt, self.tokenizer, self.kwargs)

    def matches_template(self, conversation: Messages, ids: list[int], generation_prompt: bool) -> bool:
        """Whether the template renders ``conversation`` as the text of
        ``ids`` (the prefix property; the end of a final model turn the
        template would close is allowed). Compared as text: a sampled turn
        need not be the tokenizer's own encoding of its text, which is why
        grpo never re-tokenises it, and is no fault of the template."""
        rendered = self._render(conversation, generation_prompt=generation_prompt)
        text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return rendered == text if generation_prompt else rendered.startswith(text)
