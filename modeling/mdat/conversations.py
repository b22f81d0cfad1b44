"""Conversations as documents: prompt/response pairs and chat messages, for instruction tuning.

An import of instruction data (`Mdat.add_pairs`, ``matformer-mdat add NAME --pairs FILE``)
reads one conversation per record: its ``messages`` field, a list in the chat format
(``{"role": "system" | "user" | "assistant", "content": "..."}``), or else its prompt and
response fields, which become a user message and an assistant message. The document stored is
the conversation as JSON, ``{"messages": [{"role": ..., "content": ...}, ...]}``; the record's
other fields are its metadata. No template is applied here: a strategy does that when it
pretokenizes (`modeling.mdat.chat_templates`), so one import serves any tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from matformer.modeling.errors import BadRecord, EmptyDocument
from matformer.modeling.mdat.records import SKIP_HINT, Record, checked_document

ROLES = ("system", "user", "assistant")
RESPONSE_ROLE = "assistant"  # the messages a model learns to write
Messages = list[dict[str, str]]


@dataclass(frozen=True, slots=True)
class PairFields:
    """Which fields of a record hold its conversation."""

    prompt: str = "prompt"
    response: str = "response"
    messages: str = "messages"  # takes precedence where a record has it

    def describe(self) -> str:
        """The submdat's text field, as the catalogue records it."""
        return f"{self.messages} | {self.prompt}, {self.response}"

    def record(self, value: Mapping[str, Any], where: str) -> Record:
        """The conversation of ``value`` as a document, or what is wrong with it."""
        if self.messages in value:
            used = {self.messages}
            messages = _messages(value[self.messages], f"{where}: field {self.messages!r}")
        else:
            used = {self.prompt, self.response}
            prompt, response = value.get(self.prompt), value.get(self.response)
            if not isinstance(prompt, str) or not isinstance(response, str):
                return BadRecord(
                    f"{where}: no string fields {self.prompt!r} and {self.response!r}, nor a "
                    f"{self.messages!r} list (fields: {', '.join(map(str, value)) or 'none'}); "
                    f"name the fields with prompt_field=, response_field=, messages_field= "
                    f"(--prompt-field, ...), {SKIP_HINT}.")
            messages = [{"role": "user", "content": prompt},
                        {"role": RESPONSE_ROLE, "content": response}]
        if isinstance(messages, BadRecord):
            return messages
        if not any(m["role"] == RESPONSE_ROLE and m["content"].strip() for m in messages):
            return EmptyDocument(f"{where}: no {RESPONSE_ROLE} message with text, so nothing to "
                                 f"learn; remove the record {SKIP_HINT}.")
        text = json.dumps({"messages": messages}, ensure_ascii=False)
        return checked_document(text, where, {k: v for k, v in value.items() if k not in used})


def _messages(value: object, where: str) -> Messages | BadRecord:
    """``value`` as checked messages holding only their role and content."""
    if not isinstance(value, list) or not value:
        return BadRecord(f"{where} is not a non-empty list of messages; {SKIP_HINT}.")
    messages = []
    for number, message in enumerate(value):
        role = message.get("role") if isinstance(message, Mapping) else None
        content = message.get("content") if isinstance(message, Mapping) else None
        if role not in ROLES or not isinstance(content, str):
            return BadRecord(
                f"{where}: message {number} is not {{\"role\": one of {list(ROLES)}, "
                f"\"content\": a string}}; {SKIP_HINT}.")
        messages.append({"role": role, "content": content})
    return messages


def conversation(text: str) -> Messages:
    """The messages of a document stored by an import of instruction data; ValueError for a
    document that is not one."""
    try:
        messages = json.loads(text)["messages"]
    except (ValueError, TypeError, KeyError):
        messages = None
    checked = _messages(messages, "the document")
    if isinstance(checked, BadRecord):
        raise ValueError(
            "the document is not a conversation (it was not imported as instruction data: "
            "Mdat.add_pairs, `matformer-mdat add NAME --pairs FILE`); pretokenize plain text "
            "with another splitter_class")
    return checked
