"""A draft's training log read and normalised into the acceptance it predicts (issue 18, the budget's first stage).

Trainers log per-position draft accuracies in three meanings; :func:`read_training_log` finds them and says which:

* ``marginal``: accuracy of draft position k on its own (teacher-forced tokens, the draft's own states), not given
  that positions < k were right. SpecForge ``{mode}/acc_{i}`` (``scripts/train_eagle3.py::record_metrcs``),
  ``eval/per_position_acc``; TorchSpec (the same ``eval/acc_{i}`` names, told apart by its ``eval/avg_acc`` /
  ``eval/avg_loss``); SafeAILab EAGLE-3 ``train/acc_{i}``, ``{train,test}/epochacc_{i}`` and the printed
  ``... Epoch [e/N], position i,  Acc: x`` lines (``eagle/traineagle3/main.py``); ours
  (``env/models/draft/training_log.json``: ``val_final.acc_per_step``, TTT accuracy per step).
* ``joint``: speculators ``full_acc_{k}`` = P(first k+1 draft tokens all right) = P(N >= k+1).
* ``conditional``: speculators ``cond_acc_{k}`` = P(position k+1 right | positions <= k right).

:func:`predicted_accept_length` turns them into SGLang's accept length (tokens per verify step, the target's bonus
token included) for ``steps`` draft steps: ``1 + sum_{k<=steps} P(N >= k)``.
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from ..errors import BadInput
from ..formats.rows import text_kind
from ..runfiles import JSONTooDeep, loads_json, read_file_bytes, regular_file

Format = Literal["specforge", "torchspec", "speculators", "eagle", "e3f"]
Kind = Literal["marginal", "joint", "conditional"]

#: what a log must hold, for the one-line error on an unknown format
EXPECTED = ("SpecForge / TorchSpec 'eval/acc_<i>', 'train/acc_<i>' or 'eval/per_position_acc'; speculators "
            "'full_acc_<k>' / 'cond_acc_<k>' (or their _sum/_total); SafeAILab EAGLE 'train/acc_<i>' or "
            "'test/epochacc_<i>'; ours 'val_final.acc_per_step'; or text lines 'position <i>, Acc: <x>'")

#: splits, most preferred first (validation before training)
_VALIDATION = ("eval", "val", "validation", "test")
#: the largest training log read (bytes): a 100k-step trainer_state.json is ~30 MiB
MAX_LOG_BYTES = 512 * 2 ** 20

_SPEC_RE = re.compile(r"^(?:(?P<split>[A-Za-z_]+)/)?(?P<which>full|cond)_acc_(?P<k>\d+)(?P<agg>_sum|_total)?$")
_EPOCH_RE = re.compile(r"^(?P<split>train|test)/epochacc_(?P<k>\d+)$")
_ACC_RE = re.compile(r"^(?P<split>[A-Za-z_]+)/acc_(?P<k>\d+)$")
_LIST_RE = re.compile(r"^(?P<split>[A-Za-z_]+)/per_position_acc$")
_OURS_RE = re.compile(r"^val_final/acc_per_step$")
_TORCHSPEC_RE = re.compile(r"^(eval|train)/(avg_acc|avg_loss)$")
_TEXT_RE = re.compile(r"position\s+(?P<k>\d+)\s*,\s*Acc:\s*(?P<v>[-+0-9.eE]+)", re.IGNORECASE)
_TEXT_SPLIT_RE = re.compile(r"\b(train|test|eval|val|validation)\b", re.IGNORECASE)


class TrainingLog(BaseModel):
    """Per-position draft accuracies read from a training log.

    Attributes:
        path: the file read.
        format: ``specforge`` | ``torchspec`` | ``speculators`` | ``eagle`` (SafeAILab) | ``e3f`` (ours).
        kind: ``marginal`` | ``joint`` | ``conditional`` (module docstring).
        per_position: accuracies in [0, 1], index 0 = the first draft token (contiguous from position 0).
        source_keys: the keys (or ``text:position <i>`` lines) the values came from, in position order.
        split: the split they belong to (``eval``, ``val``, ``test``, ``train``...; validation preferred).
        entry: index of the log-history entry used when the file is a history (JSON list, JSONL,
            ``log_history``), else None.
        reported_accept_length / reported_key: the log's own accept-length figure, if it has one
            (SpecForge / TorchSpec ``<split>/simulated_acc_len``; ours ``val_final.proxy_accept_length_<S>_steps``).
        reported_steps: how many positions that figure covers (all logged ones, or ``S``).
        reported_includes_bonus: whether that figure equals ``1 + sum prod`` (True) or ``sum prod`` (False) of the
            logged accuracies over ``reported_steps``; None when it matches neither.
        per_position_loss / loss_keys: the trainer's per-step loss of the same split and entry (SpecForge /
            TorchSpec ``<split>/ploss_<i>``, SafeAILab EAGLE ``<split>/epochploss_<i>``, ours
            ``val_final.loss_per_step``), nats; None when the log has none (speculators logs a KL loss, not read).
        data_text / data_text_source: what the logged rows' text was (``sampled`` / ``greedy`` / ``mixed`` /
            ``dataset``, :func:`helpers.formats.training_data.text_kind`) when the log records its data
            (ours: ``data.manifest.sequences``), and the key it came from.
        notes: what was assumed or left out.
    """

    model_config = ConfigDict(extra="forbid")

    path: str
    format: Format
    kind: Kind
    per_position: list[float]
    source_keys: list[str]
    split: str = ""
    entry: Optional[int] = None
    reported_accept_length: Optional[float] = None
    reported_key: Optional[str] = None
    reported_steps: Optional[int] = None
    reported_includes_bonus: Optional[bool] = None
    per_position_loss: Optional[list[float]] = None
    loss_keys: list[str] = Field(default_factory=list)
    data_text: Optional[str] = None
    data_text_source: Optional[str] = None
    notes: list[str] = Field(default_factory=list)


# ------------------------------------------------------------------------------------------------ reading

def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def _split_rank(split: str) -> int:
    s = (split or "").lower()
    if s in _VALIDATION:
        return 0
    if s == "train":
        return 1
    return 2


def _number(v: Any, path: Path, key: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadInput(f"expected a number, got {v!r}", path=path, field=key)
    x = float(v)
    if not math.isfinite(x):
        raise BadInput(f"expected a finite number, got {v!r}", path=path, field=key)
    return x


def _fraction(v: Any, path: Path, key: str) -> float:
    x = _number(v, path, key)
    if not 0.0 <= x <= 1.0:
        raise BadInput(f"expected an accuracy in [0, 1], got {x!r} (a percentage?)", path=path, field=key)
    return x


def validation_rows_checked(doc: dict, path: str | Path) -> Optional[dict]:
    """A log's ``validation_rows`` block (the figures a trainer measured on the rows it names: ``path``, ``rows``,
    ``acc_per_step``, ``loss_per_step``, as ``env/models/train_nextn.py`` / ``train_eagle1.py`` write it), checked
    with the same rules as the log's other accuracies (:func:`_fraction`, :func:`_number`); None when absent or null.

    Returns:
        a copy with ``acc_per_step`` / ``loss_per_step`` as lists of floats (accuracies as fractions in [0, 1]).

    Raises:
        BadInput: one line naming ``path`` and the field: ``validation_rows`` not an object; ``acc_per_step`` /
            ``loss_per_step`` not a list, an accuracy not a finite number in [0, 1], a loss not a finite number;
            ``path`` not a string; ``rows`` not a positive integer."""
    p = Path(path)
    vr = doc.get("validation_rows")
    if vr is None:
        return None
    if not isinstance(vr, dict):
        raise BadInput(f"expected an object {{path, rows, acc_per_step}}, got {vr!r:.60}", path=p,
                       field="validation_rows")
    out = dict(vr)
    for key, conv in (("acc_per_step", _fraction), ("loss_per_step", _number)):
        v = vr.get(key)
        if v is None:
            continue
        if not isinstance(v, list):
            raise BadInput(f"expected a list of numbers (one per draft step), got {v!r:.60}", path=p,
                           field=f"validation_rows.{key}")
        out[key] = [conv(x, p, f"validation_rows.{key}[{i}]") for i, x in enumerate(v)]
    if vr.get("path") is not None and not isinstance(vr["path"], str):
        raise BadInput(f"expected a folder path (string), got {vr['path']!r:.60}", path=p, field="validation_rows.path")
    r = vr.get("rows")
    if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
        raise BadInput(f"expected a positive integer (the row count), got {r!r:.60}", path=p,
                       field="validation_rows.rows")
    return out


def _contiguous(found: dict[int, tuple[float, str]], notes: list[str]) -> tuple[list[float], list[str]]:
    """Values for positions 0, 1, ... up to the first gap (the rest noted)."""
    vals, keys = [], []
    k = 0
    while k in found:
        vals.append(found[k][0])
        keys.append(found[k][1])
        k += 1
    rest = sorted(i for i in found if i >= k)
    if rest:
        notes.append(f"position {k} is missing from the log: positions {rest} after the gap are not used")
    return vals, keys


def _candidates(m: dict[str, Any], path: Path) -> list[dict]:
    """Every reading of one flat metrics dict: ``{format, kind, split, found: {k: (value, key)}, rank}``."""
    cands: dict[tuple, dict] = {}

    def add(fmt: str, kind: str, split: str, k: int, v: float, key: str) -> None:
        c = cands.setdefault((fmt, kind, split), {"format": fmt, "kind": kind, "split": split, "found": {}})
        c["found"][k] = (v, key)

    sums: dict[tuple, dict] = {}
    for key, v in m.items():
        if (g := _SPEC_RE.match(key)) is not None:
            kind = "joint" if g["which"] == "full" else "conditional"
            split = g["split"] or ""
            if g["agg"]:
                sums.setdefault((kind, split, int(g["k"])), {})[g["agg"]] = (v, key)
            else:
                add("speculators", kind, split, int(g["k"]), _fraction(v, path, key), key)
        elif (g := _EPOCH_RE.match(key)) is not None:
            add("eagle", "marginal", g["split"], int(g["k"]), _fraction(v, path, key), key)
        elif (g := _ACC_RE.match(key)) is not None:
            add("specforge", "marginal", g["split"], int(g["k"]), _fraction(v, path, key), key)
        elif (g := _LIST_RE.match(key)) is not None or _OURS_RE.match(key):
            if not isinstance(v, list) or not v:
                raise BadInput(f"expected a non-empty list of accuracies, got {v!r}", path=path, field=key)
            fmt, split = ("e3f", "val") if g is None else ("specforge", g["split"])
            for k, x in enumerate(v):
                add(fmt, "marginal", split, k, _fraction(x, path, f"{key}[{k}]"), f"{key}[{k}]")
    for (kind, split, k), parts in sums.items():
        if "_sum" not in parts or "_total" not in parts:
            continue
        (s, skey), (t, tkey) = parts["_sum"], parts["_total"]
        s, t = _number(s, path, skey), _number(t, path, tkey)
        if t <= 0:
            continue
        add("speculators", kind, split, k, _fraction(s / t, path, f"{skey} / {tkey}"), f"{skey} / {tkey}")
    # a per_position_acc list and acc_<i> keys of the same split merge into one reading (the same numbers)
    out = list(cands.values())
    if any(c["format"] == "specforge" for c in out) and any(_TORCHSPEC_RE.match(k) for k in m):
        for c in out:
            if c["format"] == "specforge":
                c["format"] = "torchspec"
    return out


def _choose(cands: list[dict]) -> Optional[dict]:
    """Validation before training; joint before conditional (speculators logs both); a longer run of positions
    before a shorter one."""
    if not cands:
        return None
    kind_rank = {"joint": 0, "marginal": 0, "conditional": 1}
    return min(cands, key=lambda c: (_split_rank(c["split"]), kind_rank[c["kind"]], -len(c["found"])))


def _entries(doc: Any, path: Path) -> tuple[list[dict], bool]:
    """The metrics dicts of a document, and whether it is a history (several entries)."""
    if isinstance(doc, dict) and isinstance(doc.get("log_history"), list):
        doc = doc["log_history"]
    if isinstance(doc, dict):
        return [_flatten(doc)], False
    if isinstance(doc, list):
        return [_flatten(e) if isinstance(e, dict) else {} for e in doc], True
    raise BadInput(f"expected a JSON object of metrics or a list of them, got {type(doc).__name__}; {EXPECTED}",
                   path=path)


def _from_entries(entries: list[dict], path: Path) -> Optional[tuple[dict, int, dict]]:
    """(chosen reading, entry index, its metrics) -- in a history the last entry holding validation keys, else the
    last holding training keys."""
    best = None
    for i, m in enumerate(entries):
        c = _choose(_candidates(m, path))
        if c is None:
            continue
        if best is None or _split_rank(c["split"]) <= _split_rank(best[0]["split"]):
            best = (c, i, m)
    return best


def _from_text(text: str) -> Optional[dict]:
    """The last ``position <i>, Acc: <x>`` value per position and split (validation lines preferred)."""
    per_split: dict[str, dict[int, tuple[float, str]]] = {}
    eagle = False
    for n, line in enumerate(text.splitlines(), 1):
        g = _TEXT_RE.search(line)
        if g is None:
            continue
        s = _TEXT_SPLIT_RE.search(line[:g.start()])
        split = s.group(1).lower() if s else ""
        eagle = eagle or bool(re.search(r"\bEpoch\s*\[\d+/\d+\]", line))
        try:
            v = float(g["v"])
        except ValueError:
            continue
        per_split.setdefault(split, {})[int(g["k"])] = (v, f"text:line {n}: position {g['k']}")
    if not per_split:
        return None
    split = min(per_split, key=lambda s: (_split_rank(s), -len(per_split[s])))
    return {"format": "eagle" if eagle else "specforge", "kind": "marginal", "split": split,
            "found": per_split[split]}


def _prod_sum(vals: list[float]) -> float:
    s, p = 0.0, 1.0
    for a in vals:
        p *= a
        s += p
    return s


def _reported(log: TrainingLog, m: dict[str, Any], path: Path) -> None:
    """The log's own accept-length figure and whether it counts the bonus token."""
    key, steps = None, None
    if log.format in ("specforge", "torchspec") and f"{log.split}/simulated_acc_len" in m:
        key, steps = f"{log.split}/simulated_acc_len", len(log.per_position)
    elif log.format == "e3f":
        for k in m:
            g = re.match(r"^val_final/proxy_accept_length_(\d+)_steps$", k)
            if g:
                key, steps = k, int(g.group(1))
                break
    if key is None or m.get(key) is None:
        return
    value = _number(m[key], path, key)
    log.reported_accept_length, log.reported_key, log.reported_steps = value, key, steps
    if steps is None or steps > len(log.per_position) or log.kind != "marginal":
        return
    s = _prod_sum(log.per_position[:steps])
    tol = 1e-3 * max(1.0, s)
    if abs(value - s) <= tol:
        log.reported_includes_bonus = False
    elif abs(value - (1.0 + s)) <= tol:
        log.reported_includes_bonus = True
    else:
        log.notes.append(f"{key} = {value:.4g} is neither sum(prod) = {s:.4g} nor 1 + sum(prod) of the logged "
                         f"accuracies over {steps} positions")


def _losses(log: TrainingLog, m: dict[str, Any], path: Path) -> None:
    """The per-step losses of the chosen split and the logged rows' text kind (see :class:`TrainingLog`)."""
    n = len(log.per_position)
    keys: list[str] = []
    if log.format == "e3f" and isinstance(m.get("val_final/loss_per_step"), list):
        keys = [f"val_final/loss_per_step[{i}]" for i in range(min(n, len(m["val_final/loss_per_step"])))]
        vals = [_number(x, path, k) for x, k in zip(m["val_final/loss_per_step"], keys)]
    else:
        pat = {"specforge": "{s}/ploss_{i}", "torchspec": "{s}/ploss_{i}", "eagle": "{s}/epochploss_{i}"}.get(log.format)
        vals = []
        if pat is not None:
            for i in range(n):
                k = pat.format(s=log.split, i=i)
                if k not in m:
                    break
                keys.append(k)
                vals.append(_number(m[k], path, k))
    if vals:
        log.per_position_loss, log.loss_keys = vals, keys
    _data_text(log, m, path)


def read_training_log(path: str | Path) -> TrainingLog:
    """Read a draft's training log: a JSON file (a dict of metrics -- wandb summary, ours --, a list of such dicts or
    ``{"log_history": [...]}`` = a log history), a JSONL file (one dict per line: a history), or a text log with
    ``position <i>, Acc: <x>`` lines.

    In a history the last entry holding validation accuracies is used (else the last with training ones); in a text
    log the last value per position, validation lines first. Positions must run 0, 1, ...: values after a gap are
    left out with a note.

    Returns:
        :class:`TrainingLog` (accuracies as fractions in [0, 1]).

    Raises:
        BadInput: missing / empty / unreadable file; no known keys (the message lists the keys expected); an
            accuracy that is not a number in [0, 1].
    """
    p = Path(path)
    if p.is_dir():
        raise BadInput("is a folder (expected a training log file: JSON, JSONL or text)", path=p)
    if not p.exists() and not p.is_symlink():
        raise BadInput("training log not found", path=p)
    text = read_file_bytes(p, "training log", max_bytes=MAX_LOG_BYTES).decode("utf-8", errors="replace")
    if not text.strip():
        raise BadInput(f"empty file (expected a training log: {EXPECTED})", path=p)

    doc: Any = None
    parsed = False
    if p.suffix != ".jsonl":
        try:
            doc, parsed = loads_json(text), True
        except json.JSONDecodeError:
            pass
        except JSONTooDeep as e:
            raise BadInput(str(e), path=p) from None
    if not parsed:
        lines = [(n, ln) for n, ln in enumerate(text.splitlines(), 1) if ln.strip()]
        doc, parsed = [], True
        for n, ln in lines:
            try:
                doc.append(loads_json(ln))
            except JSONTooDeep as e:
                raise BadInput(str(e), path=p) from None
            except json.JSONDecodeError as e:
                if p.suffix == ".jsonl":
                    raise BadInput(f"not valid JSONL (line {n}: {e.msg} at column {e.colno})", path=p) from None
                parsed = False
                break
        parsed = parsed and all(isinstance(e, dict) for e in doc)

    notes: list[str] = []
    entry, metrics = None, {}
    if parsed:
        entries, history = _entries(doc, p)
        got = _from_entries(entries, p)
        if got is None:
            seen = sorted({k for e in entries for k in e})[:12]
            more = " ..." if len(seen) == 12 else ""
            raise BadInput(f"no per-position draft accuracies found (keys seen: {seen}{more}; expected {EXPECTED})",
                           path=p)
        chosen, i, metrics = got
        if history:
            entry = i
            notes.append(f"entry {i} of {len(entries)} in the log history (the last holding "
                         f"{'validation' if _split_rank(chosen['split']) == 0 else 'training'} accuracies)")
    else:
        chosen = _from_text(text)
        if chosen is None:
            raise BadInput(f"neither JSON nor a text log with accuracy lines (expected {EXPECTED})", path=p)
        for k, (v, key) in chosen["found"].items():
            _fraction(v, p, key)
    vals, keys = _contiguous(chosen["found"], notes)
    if not vals:
        raise BadInput(f"no accuracy for draft position 0 (found positions {sorted(chosen['found'])}; expected "
                       f"{EXPECTED})", path=p)
    if _split_rank(chosen["split"]) > 0:
        notes.append(f"accuracies of the '{chosen['split'] or 'unnamed'}' split (no validation accuracies in the log)")
    log = TrainingLog(path=str(p), format=chosen["format"], kind=chosen["kind"], per_position=vals, source_keys=keys,
                      split=chosen["split"], entry=entry, notes=notes)
    if parsed:
        _reported(log, metrics, p)
        _losses(log, metrics, p)
        if log.data_text is None and entry is not None:       # a history: the run's data may be in another entry
            for e in entries:
                _data_text(log, e, p)
                if log.data_text is not None:
                    break
    return log


def _data_text(log: TrainingLog, m: dict[str, Any], path: Path) -> None:
    """The logged rows' text kind from a ``sequences`` description in the log (ours: ``data.manifest.sequences``)."""
    for k, v in m.items():
        if isinstance(v, str) and (k == "sequences" or k.endswith("/sequences")) and text_kind(v):
            log.data_text, log.data_text_source = text_kind(v), f"{path} ({k}: {v!r})"
            return


# ------------------------------------------------------------------------------------------------ prediction

def predicted_accept_length(log: TrainingLog, steps: int) -> dict:
    """The accept length a training log predicts for ``steps`` draft steps (chain drafting, topk 1).

    ``P(N >= k)`` (N = draft tokens accepted in one verify step) for k = 1..steps from the log's accuracies:
    marginal ``a_j``: ``prod_{j<=k} a_j`` (an independence approximation: a position's accuracy is taken as if it did
    not depend on the earlier ones being right); joint ``full_acc_{k-1}``: read directly; conditional ``c_j``:
    ``prod_{j<=k} c_j``. Accept length = ``1 + sum_k P(N >= k)``: the target's bonus token included, as SGLang counts
    it (accepted draft tokens + 1 per verify step).

    Args:
        log: from :func:`read_training_log`.
        steps: draft steps S (``--speculative-num-steps``), >= 1.

    Returns:
        ``{"accept_length": float, "p_accept_ge": [P(N>=1), ...], "kind", "format", "steps", "positions_used",
        "complete": bool, "note": str}``; when the log has fewer than ``steps`` positions, ``p_accept_ge`` stops there,
        ``complete`` is False and the note says the accept length covers only the logged positions (a lower bound).

    Raises:
        BadInput: ``steps`` < 1.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise BadInput(f"expected a positive number of draft steps, got {steps!r}", field="steps")
    a = log.per_position
    n = min(steps, len(a))
    p: list[float] = []
    if log.kind == "joint":
        p = [float(x) for x in a[:n]]
        how = "joint accuracies full_acc_{k-1} = P(N >= k), read directly"
        if any(p[i + 1] > p[i] + 1e-9 for i in range(len(p) - 1)):
            how += " (they rise with k, which a joint probability cannot: the log's positions were not measured " \
                   "on the same tokens)"
    else:
        prod = 1.0
        for x in a[:n]:
            prod *= x
            p.append(prod)
        how = ("marginal accuracies multiplied: P(N >= k) = prod_{j<=k} a_j, an independence approximation (a "
               "position is taken to be right as often after a right prefix as overall)" if log.kind == "marginal"
               else "conditional accuracies multiplied: P(N >= k) = prod_{j<=k} cond_acc_{j-1}")
    note = f"{how}; accept length = 1 (bonus token) + sum of P(N >= k) for k <= {n}"
    if n < steps:
        note += (f"; the log has {len(a)} position(s), positions {len(a) + 1}..{steps} are missing: the accept length "
                 f"covers {len(a)} step(s) only (a lower bound for {steps} steps)")
    return {"accept_length": 1.0 + sum(p), "p_accept_ge": p, "kind": log.kind, "format": log.format, "steps": steps,
            "positions_used": n, "complete": n == steps, "note": note}


#: file names looked for in the draft folder (and its parent) when no --training-log is given
TRAINING_LOG_NAMES = ("training_log.json", "trainer_state.json", "eval_results.json", "metrics.json",
                      "training_log.jsonl", "train.log")

def find_training_log(draft_dir: Path, given: Optional[str | Path] = None) -> Optional[Path]:
    """``given``, else the first of :data:`TRAINING_LOG_NAMES` in the draft folder or its parent.

    Raises:
        BadInput: ``given`` is not a regular file (missing, a FIFO, a device, a symlink loop:
            :func:`helpers.runfiles.regular_file`), naming it and ``--training-log``."""
    if given is not None:
        p = Path(given)
        try:        # the one reader rule: missing, a symlink loop, a FIFO, a device, a folder -- said as what it is
            return regular_file(p, "training log")
        except BadInput as exc:
            raise BadInput(exc.message, path=p, field="--training-log") from None
    for folder in (draft_dir, draft_dir.parent):
        for n in TRAINING_LOG_NAMES:
            if os.path.lexists(folder / n) and not (folder / n).is_dir():     # a FIFO of the name: refused when read
                return folder / n
    return None


#: where a draft's validation rows (rows of its log's kind) are looked for when none are given
VALIDATION_NAMES = ("validation", "val", "eval")


def find_validation_data(draft_dir: Path, *, training: Optional[str | Path] = None, given: Optional[str | Path] = None,
                         log_path: Optional[Path] = None) -> tuple[Optional[Path], str]:
    """The rows the draft stage measures the checkpoint on: ``given`` (``--validation``); else the training log's own
    pointer to its validation data (a ``validation_data`` path in the log, relative to the log file); else a folder
    named ``validation`` (``val``, ``eval``) beside the training data or inside the draft folder. Returns
    ``(path or None, where it came from)``.

    Raises:
        BadInput: ``given`` does not exist."""
    if given is not None:
        p = Path(given)
        if not p.exists():
            raise BadInput("validation data not found", path=p, field="--validation")
        return p, "--validation"
    if log_path is not None and log_path.suffix == ".json":
        try:
            doc = loads_json(read_file_bytes(log_path, "training log", max_bytes=MAX_LOG_BYTES).decode(
                "utf-8", errors="replace"))
        except (OSError, ValueError, JSONTooDeep):     # BadInput is a ValueError: no reference, the other places
            doc = None
        ref = doc.get("validation_data") if isinstance(doc, dict) else None
        if isinstance(ref, str) and (log_path.parent / ref).exists():
            return (log_path.parent / ref).resolve(), f"{log_path} (validation_data)"
    places = []
    if training is not None:
        t = Path(training)
        places.append((t if t.is_dir() else t.parent).parent)
    places.append(Path(draft_dir))
    for folder in places:
        for n in VALIDATION_NAMES:
            if (folder / n).is_dir() and (Path(training).resolve() != (folder / n).resolve() if training else True):
                return folder / n, f"found beside the {'training data' if folder != Path(draft_dir) else 'draft'}"
    return None, "none found"
