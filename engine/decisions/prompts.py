"""The decision templates: how a state and one question are shown to the model, and which token answers it.

Label scoring asks each question so that the reply's first token is the answer: a label per option, read off the
model's next-token probabilities at the answer position. Labels:
    noul    "Yes" / "No"               (P(true) is the "Yes" share)
    choice  "A", "B", ... "P"          (the options in the order sent, each shown with its description)
    score   "0", "1", ... "9"          (the levels in order, each shown with its description)

Two templates (docs/decisions.md shows both in full):
    chat-v1  the model's own chat template: one user message (the state, then the question, its options and the
             instruction to answer with the label only), the assistant's turn opened, thinking off; the label is
             the reply's first token. For instruct models (the default).
    bare-v1  no chat template: the same text followed by "Answer:", the label after a space. For base models.
The state comes first in both, so every question of a request shares the state's tokens (prefilled once).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.api.decisions import Question
from engine.errors import UnsupportedModel
from engine.models.base import Model
from engine.requests.prompts import encode_prompt, thinking_of
from engine.thinking.harmony import ANSWER_NOW
from engine.thinking.template import render_prompt

__all__ = ["TEMPLATES", "Prompt", "labels_of", "question_prompt"]

TEMPLATES = ("chat-v1", "bare-v1")
_LETTERS = "ABCDEFGHIJKLMNOP"


@dataclass(frozen=True)
class Prompt:
    ids: list[int]  # the whole prompt, up to the answer position
    label_ids: list[int]  # per option (the question's order), the token that answers with it


def labels_of(question: Question) -> list[str]:
    if question.kind == "noul":
        return ["Yes", "No"]
    if question.kind == "choice":
        return list(_LETTERS[:len(question.options)])
    return [str(i) for i in range(len(question.options))]


def _content(value) -> str:
    """A content field as the model reads it: text as is, a JSON object or array as compact JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def question_text(state, question: Question) -> str:
    """The user-facing text of one question about the state (both templates)."""
    lines = [_content(state).strip(), "", "---", ""]
    if question.instructions is not None:
        lines.append(f"Question: {_content(question.instructions).strip()}")
    labels = labels_of(question)
    if question.kind == "noul":
        true, false = question.descriptions
        if question.instructions is None:
            lines.append("Question: does the statement below hold?")
        if true is not None:
            lines.append(f"Yes means: {_content(true).strip()}")
        if false is not None:
            lines.append(f"No means: {_content(false).strip()}")
        lines.append("Answer with Yes or No only.")
    elif question.kind == "choice":
        lines.append("Options:")
        for label, option, description in zip(labels, question.options, question.descriptions):
            lines.append(f"{label}. {option}" + (f": {_content(description).strip()}" if description is not None
                                                 else ""))
        lines.append(f"Answer with the letter of one option only ({', '.join(labels)}).")
    else:
        lines.append("Levels:")
        for label, description in zip(labels, question.descriptions):
            lines.append(f"{label}: {_content(description).strip()}")
        lines.append(f"Answer with the number of one level only ({labels[0]} to {labels[-1]}).")
    return "\n".join(lines)


def question_prompt(model: Model, template: str, state, question: Question) -> Prompt:
    """The prompt ids of one question under `template`, and its options' answer tokens."""
    text = question_text(state, question)
    if template == "chat-v1":
        if model.template is None:
            raise UnsupportedModel(f"{model.name} has no chat template; serve it with --decisions-template bare-v1")
        thinking = thinking_of(model)
        prompt = render_prompt(model.template, thinking, [{"role": "user", "content": text}], mode="off").text
        if thinking is not None and thinking.harmony:  # gpt-oss has no off form: the label opens its final channel
            prompt += ANSWER_NOW
        sep = ""
    else:
        prompt, sep = text + "\nAnswer:", " "
    ids = encode_prompt(model, prompt)
    return Prompt(ids, [_answer_token(model, prompt, ids, sep + label) for label in labels_of(question)])


def _answer_token(model: Model, prompt: str, ids: list[int], label: str) -> int:
    """The token the reply starts with when it answers `label` right after the prompt: the first token past the
    prompt's own when the prompt and label are encoded together (the prompt's tokens must be a prefix), else the
    label's first token alone."""
    both = encode_prompt(model, prompt + label)
    if both[:len(ids)] == ids and len(both) > len(ids):
        return both[len(ids)]
    alone = model.tokenizer.encode(label, add_bos=False)
    if not alone:
        raise UnsupportedModel(f"{model.name}: the label {label!r} encodes to no token")
    return alone[0]
