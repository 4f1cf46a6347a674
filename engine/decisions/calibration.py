"""Calibration of decisions: one temperature per kind, fitted on a labelled set, applied as p = softmax(z / T).

    read_labelled(path)                    -> [LabelledItem]: a decisions request and its correct answers per line
    fit_temperature(logits, answers)       -> T minimising the negative log-likelihood (bounded 1-D search)
    metrics(logits, answers, T)            -> NLL, ECE (15 equal-width bins over the top probability), top-1
    model_identity(model) / save / load    the calibration file, and the check that it fits the served model
    Journal(path, header)                  the scored items of an unfinished run, one fsynced JSON line each, so
                                           that a rerun of the same model, template and set resumes

The NLL is convex in beta = 1/T (a log-sum-exp of beta z less a linear term), so a golden-section search over a
bounded beta interval finds its minimum; T is searched in [0.05, 20].
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.api.decisions import DecisionInvalid, DecisionRequest, parse_decision_request
from engine.errors import GoinferError

__all__ = ["CalibrationError", "Journal", "LabelledItem", "apply_file", "calibrate", "calibration_for",
           "fit_temperature", "journal_header", "metrics", "model_identity", "read_labelled"]

FORMAT = "goinfer-decisions-calibration/1"
JOURNAL_FORMAT = "goinfer-decisions-calibration-journal/1"
T_RANGE = (0.05, 20.0)
ECE_BINS = 15


class CalibrationError(GoinferError):
    """A labelled set or calibration file that cannot be used (the message names the line or field)."""


@dataclass(frozen=True)
class LabelledItem:
    request: DecisionRequest
    answers: dict[str, int]  # question name -> index of its correct option


def read_labelled(path: str | Path) -> list[LabelledItem]:
    """Each line: a decisions request body plus "answers": {question: correct} (noul true/false, choice the
    option's name, score the level's integer). Questions without an answer are not scored."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CalibrationError(f"{path}: cannot read ({e})") from None
    items = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            answers = obj.pop("answers")
            req = parse_decision_request(obj)
        except (ValueError, AttributeError, KeyError, TypeError):
            raise CalibrationError(f"{path}:{n}: not a JSON decisions request with \"answers\"") from None
        except DecisionInvalid as e:
            raise CalibrationError(f"{path}:{n}: {e}") from None
        names = {q.name for q in req.questions}
        unknown = sorted(set(answers) - names) if isinstance(answers, dict) else None
        if unknown is None or unknown:
            raise CalibrationError(f"{path}:{n}: answers must name its questions ({', '.join(sorted(names))}); "
                                   f"got {unknown if unknown is not None else answers!r}")
        indices = {}
        for q in req.questions:
            if q.name not in answers:
                continue
            value = answers[q.name]
            key = ("true" if value else "false") if q.kind == "noul" and isinstance(value, bool) else str(value)
            if key not in q.options:
                raise CalibrationError(f"{path}:{n}: answers.{q.name}: {value!r} is not one of its options "
                                       f"({', '.join(q.options)})")
            indices[q.name] = q.options.index(key)
        items.append(LabelledItem(req, indices))
    if not items:
        raise CalibrationError(f"{path}: no labelled items")
    return items


def _grouped(logits: list[np.ndarray], answers: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The items stacked by option count (a kind's questions may differ in it): [(z (n, k), y (n,))]."""
    groups: dict[int, tuple[list, list]] = {}
    for z, y in zip(logits, answers):
        zs, ys = groups.setdefault(len(z), ([], []))
        zs.append(np.asarray(z, np.float64))
        ys.append(y)
    return [(np.stack(zs), np.array(ys)) for zs, ys in groups.values()]


def _nll(groups: list[tuple[np.ndarray, np.ndarray]], beta: float) -> float:
    total, count = 0.0, 0
    for z, y in groups:
        s = beta * z
        top = s.max(axis=1)
        total += float((top + np.log(np.exp(s - top[:, None]).sum(axis=1)) - s[np.arange(len(y)), y]).sum())
        count += len(y)
    return total / count


def fit_temperature(logits: list[np.ndarray], answers: list[int]) -> float:
    """The temperature in T_RANGE that minimises the mean negative log-likelihood of the answers."""
    if not answers:
        raise CalibrationError("no items to fit a temperature on")
    groups = _grouped(logits, answers)
    lo, hi = 1 / T_RANGE[1], 1 / T_RANGE[0]
    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = _nll(groups, c), _nll(groups, d)
    for _ in range(80):  # the bracket shrinks by 0.618 a step: far below any T that matters
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = _nll(groups, c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = _nll(groups, d)
    return 1 / ((a + b) / 2)


def metrics(logits: list[np.ndarray], answers: list[int], temperature: float = 1.0) -> dict:
    """NLL, ECE and top-1 accuracy of the answers under p = softmax(z / T)."""
    probs = []
    for z in logits:
        s = np.asarray(z, np.float64) / temperature
        e = np.exp(s - s.max())
        probs.append(e / e.sum())
    top = np.array([p.max() for p in probs])
    right = np.array([int(np.argmax(p)) == y for p, y in zip(probs, answers)], float)
    bins = np.minimum((top * ECE_BINS).astype(int), ECE_BINS - 1)
    ece = sum(abs(right[bins == b].mean() - top[bins == b].mean()) * (bins == b).mean()
              for b in range(ECE_BINS) if (bins == b).any())
    nll = float(np.mean([-math.log(max(p[y], 1e-300)) for p, y in zip(probs, answers)]))
    return {"nll": round(nll, 6), "ece": round(float(ece), 6), "top1": round(float(right.mean()), 6)}


def model_identity(model) -> dict:
    """What a calibration file names its model by: the file's name, size and the sha256 of its first 16 MiB
    (the header, metadata and first tensors: enough to tell two checkpoints apart without reading gigabytes)."""
    path = Path(model.path)
    digest = hashlib.sha256()
    target = path if path.is_file() else path / "config.json"
    with open(target, "rb") as f:
        digest.update(f.read(16 << 20))
    return {"file": path.name, "bytes": target.stat().st_size, "sha256_head": digest.hexdigest()}


def read_file(path: str | Path, template: str) -> dict:
    """A calibration file's object, refused when it is not one or was fitted under another template (what can be
    told before any model is loaded)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CalibrationError(f"--decisions-calibration {path}: cannot read it as JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CalibrationError(f"--decisions-calibration {path}: not a goinfer decisions calibration ({FORMAT})")
    if data.get("template") != template:
        raise CalibrationError(f"--decisions-calibration {path}: fitted under template {data.get('template')!r}, "
                               f"but the server shows questions with {template!r}")
    return data


def apply_file(path: str | Path, model, template: str) -> dict[str, float]:
    """The per-kind temperatures of a calibration file, refused when it was fitted for another model or template."""
    path = Path(path)
    data = read_file(path, template)
    if data.get("model") != model_identity(model):
        raise CalibrationError(f"--decisions-calibration {path}: fitted for {data.get('model', {}).get('file')!r}, "
                               f"not for the served {Path(model.path).name!r}")
    try:
        return {kind: float(v["temperature"]) for kind, v in data["kinds"].items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        raise CalibrationError(f"--decisions-calibration {path}: its kinds lack a temperature") from None


def calibration_for(path: str | Path, models: dict, template: str) -> tuple[str, dict[str, float]]:
    """(the served model's name, its per-kind temperatures) of the one model in `models` (name -> Model) that a
    calibration file was fitted for; refused when it fits none of them or another template."""
    problems = []
    for name, model in models.items():
        try:
            return name, apply_file(path, model, template)
        except CalibrationError as e:
            problems.append(str(e))
    if len(problems) == 1:
        raise CalibrationError(problems[0])
    raise CalibrationError(f"--decisions-calibration {path}: fits none of the served models ({'; '.join(problems)})")


def journal_header(model, template: str, labelled: str | Path, items: int) -> dict:
    """What a journal must match to be resumed: the model, the template and the labelled file's bytes."""
    digest = hashlib.sha256(Path(labelled).read_bytes()).hexdigest()
    return {"format": JOURNAL_FORMAT, "model": model_identity(model), "template": template,
            "labelled": {"sha256": digest, "items": items}}


class Journal:
    """The items an unfinished calibration run has scored: a header line, then {"item": n, "logits": {question:
    [label logits]}} per scored item, each line flushed and fsynced before the next item starts. Opening an existing
    journal reads its items into `scored` (a line a kill cut in half is dropped) and refuses one whose header does
    not match this run's."""

    def __init__(self, path: str | Path, header: dict):
        self.path = Path(path)
        self.scored: dict[int, dict[str, list[float]]] = {}
        if self.path.exists():
            self._resume(header)
            self._file = open(self.path, "a", encoding="utf-8")
        else:
            self._file = open(self.path, "w", encoding="utf-8")
            self._write(header)
            from engine.files import fsync_dir

            fsync_dir(self.path.parent)

    def _resume(self, header: dict) -> None:
        try:
            data = self.path.read_bytes()
        except OSError as e:
            raise CalibrationError(f"{self.path}: cannot read the journal ({e.strerror})") from None
        end = data.rfind(b"\n") + 1  # what follows the last newline is a line a kill cut in half
        if end < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(end)
        lines = data[:end].decode("utf-8", "replace").splitlines()
        try:
            found = json.loads(lines[0]) if lines else None
            entries = [json.loads(line) for line in lines[1:]]
            scored = {int(e["item"]): {q: [float(v) for v in z] for q, z in e["logits"].items()} for e in entries}
        except (ValueError, KeyError, TypeError, AttributeError):
            raise CalibrationError(f"{self.path}: not a decisions-calibrate journal; delete it to start over") from None
        if not isinstance(found, dict) or found.get("format") != JOURNAL_FORMAT:
            raise CalibrationError(f"{self.path}: not a decisions-calibrate journal; delete it to start over")
        differs = [what for key, what in (("model", "model"), ("template", "template"), ("labelled", "labelled set"))
                   if found.get(key) != header[key]]
        if differs:
            raise CalibrationError(f"{self.path}: a journal of another run (its {' and '.join(differs)} differ); "
                                   "rerun with the same model, template and set, or delete it to start over")
        self.scored = scored

    def _write(self, obj: dict) -> None:
        self._file.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def add(self, item: int, logits: dict[str, list[float]]) -> None:
        self._write({"item": item, "logits": logits})
        self.scored[item] = logits

    def close(self) -> None:
        self._file.close()

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


def calibrate(model, items: list[LabelledItem], template: str, on_item=None, held_out_every: int = 5,
              journal: Journal | None = None) -> dict:
    """Score every labelled item on model, fit one temperature per kind on the items outside the held-out split
    (every `held_out_every`-th item), and report NLL, ECE and top-1 before and after on both parts.
    on_item(done, total) after each item scored by this call. With a journal, the items it holds are not scored
    again and each newly scored one is added to it. Returns the calibration file's object."""
    from engine.decisions.scoring import score_request

    scored = journal.scored if journal is not None else {}
    done = sum(1 for n in range(len(items)) if n in scored)
    for n, item in enumerate(items):
        if n in scored:
            continue
        result = score_request(model, item.request, template)
        logits = {q.name: [float(v) for v in result.label_logits[q.name]]
                  for q in item.request.questions if q.name in item.answers}
        if journal is not None:
            journal.add(n, logits)
        else:
            scored[n] = logits
        done += 1
        if on_item is not None:
            on_item(done, len(items))
    fit: dict[str, tuple[list, list]] = {}
    held: dict[str, tuple[list, list]] = {}
    for n, item in enumerate(items):
        part = held if held_out_every and n % held_out_every == held_out_every - 1 else fit
        for q in item.request.questions:
            if q.name in item.answers:
                z, y = part.setdefault(q.kind, ([], []))
                z.append(np.asarray(scored[n][q.name], np.float64))
                y.append(item.answers[q.name])
    kinds = {}
    for kind in ("noul", "choice", "score"):
        if kind not in fit:
            continue
        logits, answers = fit[kind]
        t = fit_temperature(logits, answers)
        entry = {"temperature": round(t, 6), "items": len(answers),
                 "before": metrics(logits, answers), "after": metrics(logits, answers, t)}
        if kind in held:
            hz, hy = held[kind]
            entry["held_out"] = {"items": len(hy), "before": metrics(hz, hy), "after": metrics(hz, hy, t)}
        kinds[kind] = entry
    if not kinds:
        raise CalibrationError("no question of the labelled set has an answer to fit on")
    return {"format": FORMAT, "template": template, "model": model_identity(model), "kinds": kinds}
