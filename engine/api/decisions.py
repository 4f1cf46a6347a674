"""POST /v1/systemone: TypeSafe's decisions wire shape. A state and named questions with a closed answer set in; a
probability distribution per question out (engine/decisions/ computes them by label scoring).

    parse_decision_request(body)        -> DecisionRequest, or DecisionInvalid (a 422 listing every broken rule)
    decision_object(req, scored, ...)   -> the response body: answers, usage, the goinfer object

Request: {"model", "state", "questions": {name: question}}, a question one of
    noul    {"type": "noul", "instructions"?, "criteria"?: {"true"?, "false"?}}   instructions or a described outcome
    choice  {"type": "choice", "instructions"?, "criteria": {option: description | null}}   2-16 options
    score   {"type": "score", "instructions"?, "criteria": [description, ...]}   2-10 levels, from 0
Text fields are content: a string, or a JSON object or array (shown to the model as JSON).
Errors are FastAPI's 422 shape, which the SDK reads: {"detail": [{"loc": ["body", ...], "msg", "type"}]}, with an
OpenAI error object beside it for other clients.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidRequest

__all__ = ["DECISIONS_URL", "KINDS", "DecisionInvalid", "DecisionRequest", "Question", "answer_object",
           "decision_object", "parse_decision_request"]

DECISIONS_URL = "/v1/systemone"
KINDS = ("noul", "choice", "score")
MAX_QUESTIONS = 64
CHOICE_OPTIONS = (2, 16)  # labelled A-P: the letters label scoring reads
SCORE_LEVELS = (2, 10)  # levels 0-9: one digit each
_QUESTION_FIELDS = {"noul": {"type", "instructions", "criteria"}, "choice": {"type", "instructions", "criteria"},
                    "score": {"type", "instructions", "criteria"}}
_BODY_FIELDS = {"model", "state", "questions", "user", "metadata"}


class DecisionInvalid(InvalidRequest):
    """Broken rules of a decisions request, each {"loc", "msg", "type"} as FastAPI reports them (a 422)."""

    def __init__(self, problems: list[dict]):
        self.problems = problems
        super().__init__("; ".join(f"{'.'.join(str(p) for p in e['loc'][1:])}: {e['msg']}" for e in problems))

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": "invalid_request_error", "param": None,
                          "code": "invalid_decision"}, "detail": self.problems}


@dataclass(frozen=True)
class Question:
    name: str
    kind: str  # noul | choice | score
    instructions: object  # content (str, dict, list) or None
    options: tuple[str, ...]  # choice: the criteria keys in order; score: "0".."n-1"; noul: ("true", "false")
    descriptions: tuple[object, ...]  # per option: its content, or None where the request gave none


@dataclass(frozen=True)
class DecisionRequest:
    model: str | None
    state: object  # content
    questions: tuple[Question, ...] = field(default_factory=tuple)


def _is_content(value) -> bool:
    return isinstance(value, (str, dict, list))


def parse_decision_request(body) -> DecisionRequest:
    problems: list[dict] = []

    def bad(loc: list, msg: str, kind: str = "value_error") -> None:
        problems.append({"loc": ["body", *loc], "msg": msg, "type": kind})

    if not isinstance(body, dict):
        raise DecisionInvalid([{"loc": ["body"], "msg": "the body must be a JSON object", "type": "dict_type"}])
    for key in sorted(set(body) - _BODY_FIELDS):
        bad([key], "unknown field", "extra_forbidden")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        bad(["model"], "must be a string", "string_type")
    state = body.get("state")
    if state is None:
        bad(["state"], "Field required", "missing")
    elif not _is_content(state) or (isinstance(state, str) and not state.strip()):
        bad(["state"], "must be non-empty text, a JSON object or an array")
    questions = body.get("questions")
    parsed: list[Question] = []
    if not isinstance(questions, dict) or not questions:
        bad(["questions"], "must be an object of at least one named question",
            "missing" if questions is None else "value_error")
    elif len(questions) > MAX_QUESTIONS:
        bad(["questions"], f"at most {MAX_QUESTIONS} questions per request (got {len(questions)})")
    else:
        for name, q in questions.items():
            question = _question(name, q, lambda loc, msg, kind="value_error", n=name:
                                 bad(["questions", n, *loc], msg, kind))
            if question is not None:
                parsed.append(question)
    if problems:
        raise DecisionInvalid(problems)
    return DecisionRequest(model if isinstance(model, str) else None, state, tuple(parsed))


def _question(name: str, q, bad) -> Question | None:
    if not name.strip():
        bad([], "a question needs a non-empty name")
        return None
    if not isinstance(q, dict):
        bad([], "must be a question object", "dict_type")
        return None
    kind = q.get("type")
    if kind not in KINDS:
        supported = ", ".join(KINDS)
        bad(["type"], f"unsupported question type {kind!r} (this server answers {supported}; box needs a "
                      "vision model goinfer does not serve for decisions)" if kind == "box" else
            f"must be one of {supported}", "literal_error")
        return None
    for key in sorted(set(q) - _QUESTION_FIELDS[kind]):
        bad([key], "unknown field", "extra_forbidden")
    instructions = q.get("instructions")
    if instructions is not None and not _is_content(instructions):
        bad(["instructions"], "must be text, a JSON object or an array")
    criteria = q.get("criteria")
    ok = True
    if kind == "noul":
        if criteria is not None and (not isinstance(criteria, dict) or set(criteria) - {"true", "false"}):
            bad(["criteria"], 'must be an object with "true" and/or "false"')
            ok = False
        described = isinstance(criteria, dict) and any(v is not None for v in criteria.values())
        if instructions is None and not described:
            bad([], "a noul question needs instructions or a described outcome (criteria.true / criteria.false)")
            ok = False
        criteria = criteria if isinstance(criteria, dict) else {}
        options, descriptions = ("true", "false"), (criteria.get("true"), criteria.get("false"))
    elif kind == "choice":
        lo, hi = CHOICE_OPTIONS
        if not isinstance(criteria, dict) or not lo <= len(criteria) <= hi:
            bad(["criteria"], f"a choice question needs an object of {lo} to {hi} options (got "
                              f"{len(criteria) if isinstance(criteria, dict) else type(criteria).__name__})")
            return None
        options, descriptions = tuple(criteria), tuple(criteria.values())
        if any(not o.strip() for o in options):
            bad(["criteria"], "an option needs a non-empty name")
            ok = False
    else:
        lo, hi = SCORE_LEVELS
        if not isinstance(criteria, list) or not lo <= len(criteria) <= hi:
            bad(["criteria"], f"a score question needs an array of {lo} to {hi} level descriptions (got "
                              f"{len(criteria) if isinstance(criteria, list) else type(criteria).__name__})")
            return None
        options, descriptions = tuple(str(i) for i in range(len(criteria))), tuple(criteria)
    for option, description in zip(options, descriptions):
        if description is not None and not _is_content(description):
            bad(["criteria", option if kind != "score" else int(option)], "must be text, a JSON object or an array")
            ok = False
    return Question(name, kind, instructions, options, descriptions) if ok else None


def _margin(p: float, n: int) -> float:
    """The top probability's margin over uniform, (n p - 1) / (n - 1): 0 when the options cannot be told apart."""
    return max(0.0, (n * p - 1) / (n - 1))


def answer_object(question: Question, probabilities: list[float]) -> dict:
    """One question's answer from its options' probabilities (in option order, summing to 1)."""
    if question.kind == "noul":
        return {"type": "noul", "noul": probabilities[0]}
    top = max(range(len(probabilities)), key=probabilities.__getitem__)
    confidence = _margin(probabilities[top], len(probabilities))
    if question.kind == "choice":
        return {"type": "choice", "choice": question.options[top], "confidence": confidence,
                "probabilities": dict(zip(question.options, probabilities))}
    return {"type": "score", "score": sum(i * p for i, p in enumerate(probabilities)), "confidence": confidence,
            "legend": dict(zip(question.options, question.descriptions)),
            "probabilities": dict(zip(question.options, probabilities))}


def decision_object(req: DecisionRequest, probabilities: dict[str, list[float]], *, model_name: str,
                    input_tokens: int, template: str, calibrated: dict[str, bool]) -> dict:
    """The response: answers in the order asked, usage (nothing is decoded), and how the answer was made."""
    kinds = sorted({q.kind for q in req.questions}, key=KINDS.index)
    return {"model": model_name,
            "answers": {q.name: answer_object(q, probabilities[q.name]) for q in req.questions},
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
            "goinfer": {"route": "label", "template": template,
                        "calibrated": {k: bool(calibrated.get(k)) for k in kinds}}}
