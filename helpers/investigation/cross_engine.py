"""The same draft on two servers, engine against engine (``python -m helpers compare-engines``): the same prompts on
both, paired per prompt, accept length and P(accepted >= j) per draft position with CIs; a difference beyond its CI
is named with the stage of the acceptance budget it comes from.

Stages, each a function over one typed state (:class:`Pair`), as :func:`helpers.investigation.live.investigate`:

1. **attach** -- each server's engine (detected from its own endpoints), version, settings, the draft and target it
   serves (:func:`helpers.investigation.attach.attach`); two drafts that differ are said, never compared silently.
2. **budget** -- each server's acceptance budget on the same training samples and the same live prompts
   (:func:`helpers.investigation.acceptance.run_budget` through the server's engine adapter): the served states of
   the training tokens, and live answers that give both the served states and the per-request counters.
3. **paired** -- the live answers of the two servers paired per prompt: the accept-length change with a paired
   bootstrap CI (:func:`helpers.acceptance.stats.paired_effect`), and per position j the change of P(accepted >= j)
   (the same resampled prompts on both sides).
4. **attribute** -- the live difference decomposed on the live prompts, paired per prompt (:func:`paired_terms`):
   **wiring** = the draft run offline on b's served states minus on a's (the same draft and tokens, both with a's
   engine's loader rules: what the states each engine fed cost), **engine** = (b's live minus its offline run) minus
   (a's) (what each engine loses after the capture point; each offline run with its own engine's loader rules),
   **draft** = on b's states, the draft with b's engine's loader rules minus with a's (which embedding, lm_head, d2t
   and norms each engine runs it with: ``LoaderRules.TABLE``), or another draft, **settings** when the servers run
   other settings. A live
   difference beyond its CI is named with each term whose CI excludes 0 in its direction; when none does, it is said
   undecided. The budget's own stage losses on the training tokens are kept beside them.

``results/compare-engines.json`` in the run folder holds the document.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import pandas as pd
import torch

from ..acceptance.prompts import load_prompts
from ..acceptance.requests import repeatability
from ..acceptance.stats import histogram_matrix, paired_effect, position_rates
from ..draft.budget import dump_sequences
from ..draft.loader import load_draft
from ..draft.simulate import simulate_sequences
from ..budget import Budget
from ..draft.precision import choose_dtype, server_dtype
from ..draft.simulate import DraftSettings
from ..engines.base import EngineAdapter
from ..engines.detect import detect
from ..errors import BadInput, ServerError
from ..formats.configs import read_draft_config, read_target_config
from ..formats.training_data import TrainingData
from ..runfiles import write_json
from ..server.client import ServerClient
from .acceptance import BudgetRequest, BudgetServer, run_budget
from .attach import Attachment, attach, same_draft, same_model

Progress = Callable[[str], None]
#: the budget stages a cross-engine difference can come from, in the order they are named
STAGES = ("wiring", "engine", "settings", "draft")


@dataclass
class Side:
    """One server of the pair: its label (``a`` / ``b``), URL, engine adapter, client, attachment, budget and live
    per-request frame."""

    label: str
    url: str
    adapter: Optional[EngineAdapter] = None
    client: Optional[ServerClient] = None
    att: Optional[Attachment] = None
    budget: Optional[dict] = None
    live: Optional[pd.DataFrame] = None
    offline: Optional[pd.DataFrame] = None
    tokens: dict = field(default_factory=dict)

    def name(self) -> str:
        return f"{self.label}: {self.adapter.label} {self.att.version} ({self.url})" if self.att else self.url


@dataclass
class Pair:
    """The one state the stages of :func:`compare_engines` fill."""

    a: Side
    b: Side
    training: Path
    run_dir: Path
    prompts: int
    max_new_tokens: int
    num_samples: int
    dl: Budget
    progress: Progress
    doc: dict = field(default_factory=dict)
    #: the draft run offline on b's live states with a's engine's loader rules (the wiring term compares one draft)
    b_as_a: Optional[pd.DataFrame] = None


def _stage_attach(p: Pair, api_key: Optional[str], target: Optional[Path] = None) -> None:
    """Each server's engine and what it serves (``target``: the target folder to read here where a server's own
    ``model_path`` is not readable, ``--target``); the same target on both (:func:`check_targets`), and the same
    draft on both or the difference said."""
    for s in (p.a, p.b):
        try:
            s.adapter = detect(s.url, api_key, budget=p.dl).adapter     # the command's one deadline (--timeout)
            s.client = s.adapter.client(s.url, api_key, timeout=600.0, budget=p.dl)
        except BadInput as exc:    # detect / the client name --url: here the server is --a or --b
            if exc.field != "--url":
                raise
            raise BadInput(exc.message, field=f"--{s.label}") from None
        except ServerError as exc:    # cannot connect, refused...: say which of the two servers
            raise ServerError(f"--{s.label}: {exc}") from None
        try:
            s.att = attach(s.client, target=target, caveats=s.adapter.capture_caveats)
        except BadInput as exc:     # which of the two servers ("pass --target DIR": compare-engines has it)
            raise BadInput(str(exc), field=exc.field or f"--{s.label}") from None
        if s.att.draft_dir is None:
            raise BadInput(f"server {s.label} runs no draft this machine can read", field=f"--{s.label}")
        p.progress(f"attach: {s.name()}, TP {s.att.tp}, draft {s.att.draft_dir}, spec {s.att.spec}")
    note = check_targets(p.a.att, p.b.att)
    p.doc["same_target"] = note is None
    if note:
        p.doc.setdefault("notes", []).append(note)
    diff = same_draft(p.a.att.draft_dir, p.b.att.draft_dir)
    p.doc["same_draft"] = diff is None
    if diff is not None:
        p.doc.setdefault("notes", []).append(f"the two servers load different drafts ({', '.join(sorted(diff))}): "
                                             "the draft stage says what that costs")


#: config.json keys that say where or with what a model was saved, not what it is
TARGET_IGNORED_KEYS = ("_name_or_path", "transformers_version")


def check_targets(a: Attachment, b: Attachment) -> Optional[str]:
    """Whether the two servers serve one target, from each server's own model path (``/server_info``
    ``model_path``; vLLM: ``/v1/models`` ``root``) and the config and weights found there
    (:func:`helpers.investigation.attach.same_model`).

    Returns: None when both folders are readable here and hold the same model (or name one folder); a note when
    the servers name different folders that cannot both be read here (the comparison then reads ``--target`` or
    the readable one for both, and cannot tell).

    Raises:
        BadInput (``--b``): both folders are readable and hold different models (config keys or weights named):
            the engines' difference would be the targets'.
    """
    sa, sb = a.served_target, b.served_target
    if not sa or not sb or str(sa) == str(sb):
        return None
    ra, rb = (Path(x) if (Path(x) / "config.json").is_file() else None for x in (sa, sb))
    if ra is None or rb is None:
        return (f"the servers name different target folders (a: {sa}, b: {sb}) and "
                f"{'neither is' if ra is None and rb is None else 'only one is'} readable here, so whether they serve "
                f"one model is not known: the comparison reads {a.target_dir} for a and {b.target_dir} for b")
    if ra.resolve() == rb.resolve():
        return None
    diff = same_model(ra, rb, "target config", ignore=TARGET_IGNORED_KEYS, fingerprint=True)
    if diff is None:
        return None
    what = "; ".join(f"config keys {', '.join(diff['config_keys'][:6])}" if k == "config_keys" else
                     f"weight files {', '.join(diff['weight_bytes'][:3])} hold other values" if k == "weight_bytes"
                     else "weight files of other names or sizes" for k in diff if k != "eagle_config")
    raise BadInput(f"the two servers serve different targets (a: {sa}, b: {sb}; they differ in {what}): "
                   "compare-engines compares one draft on one target served by two engines; serve the same target "
                   "on both", field="--b")


def _stage_budget(p: Pair) -> None:
    """Each server's acceptance budget on the same training samples and live prompts."""
    for s in (p.a, p.b):
        t0 = time.monotonic()
        tcfg = read_target_config(s.att.target_dir)
        samples = list(TrainingData(p.training, hidden_size=tcfg.hidden_size, max_samples=p.num_samples))
        out = p.run_dir / "dumps" / s.label
        served = s.adapter.capture_served(s.client, samples, out, name="served", max_width=16 * tcfg.hidden_size)
        spec = s.att.spec
        br = run_budget(BudgetRequest(
            draft_dir=s.att.draft_dir, target_dir=s.att.target_dir, training=p.training,
            hidden_size=tcfg.hidden_size, num_samples=p.num_samples, served_dump=served,
            run_dir=p.run_dir / "sides" / s.label,
            settings=DraftSettings(int(spec["num_steps"]), int(spec["topk"]), int(spec["num_draft_tokens"])),
            prompts=p.prompts, max_new_tokens=p.max_new_tokens),
            BudgetServer(s.client, s.att.info, s.adapter), progress=lambda m, s=s: p.progress(f"{s.label}: {m}"))
        s.budget, s.live = br.budget, br.live
        s.offline, s.tokens = _offline_on_live(s, p)
        p.progress(f"budget {s.label}: " + ", ".join(f"{x['name']} {x['accept_length']:.2f}" for x in s.budget["stages"]
                                                     if x.get("accept_length") is not None)
                   + f" ({time.monotonic() - t0:.0f} s)")
    p.b_as_a = _offline_on_live(p.b, p, loader_of=p.a)[0]


def _draft(s: Side, loader_of: Side) -> Eagle3Draft:
    """``s``'s draft in the budget's compute dtype, with the tensors ``loader_of``'s engine runs it with (its loader
    rules: embedding, lm_head, d2t, norms)."""
    return load_draft(s.att.draft_dir, s.att.target_dir,
                      dtype=choose_dtype(server_dtype(s.att.info, read_draft_config(s.att.draft_dir).raw),
                                         "cpu").dtype,      # the budget's choice
                      loader=loader_of.adapter.loader_rules(loader_of.att.version))


def _same_tensors(x: Eagle3Draft, y: Eagle3Draft) -> bool:
    return x.arch == y.arch and torch.equal(x.embed, y.embed) and torch.equal(x.lm_head, y.lm_head) and (
        (x.hot_token_id is None and y.hot_token_id is None) or (x.hot_token_id is not None and y.hot_token_id
                                                                 is not None and torch.equal(x.hot_token_id,
                                                                                             y.hot_token_id)))


def _offline_on_live(s: Side, p: Pair, loader_of: Optional[Side] = None) -> tuple[pd.DataFrame, dict]:
    """The draft run offline (as the budget runs it: :func:`helpers.draft.simulate.simulate_sequences`) on the
    states this server fed for the live prompts (the budget's live capture), one row per prompt, and the tokens of
    each prompt's sequence. ``loader_of``: the side whose engine's loader rules pick the draft's tensors (default
    ``s``); when they pick the same tensors as ``s``'s, ``s.offline`` is returned as is."""
    dumps = sorted((p.run_dir / "sides" / s.label / "dumps").glob("live-continuations*"))
    spec = s.att.spec
    settings = DraftSettings(int(spec["num_steps"]), int(spec["topk"]), int(spec["num_draft_tokens"]))
    draft = _draft(s, loader_of or s)
    if loader_of is not None and s.offline is not None and _same_tensors(draft, _draft(s, s)):
        return s.offline, s.tokens
    seqs = [q for d in dumps for q in dump_sequences(d)]
    sim = simulate_sequences(draft, seqs, [settings], max_new_tokens=p.max_new_tokens)
    return sim["per_request"][settings], {q.key: q.tokens.tolist() for q in seqs}


def paired_terms(frames: dict[str, pd.DataFrame], terms: dict[str, dict[str, float]], *, n_boot: int = 4000,
                 level: float = 0.95, seed: int = 0) -> dict[str, dict]:
    """Linear combinations of accept lengths (ratio of sums: completion tokens / verify steps) of several
    per-request frames over the same prompts, with a paired bootstrap CI (the prompts resampled jointly in every
    frame). ``terms``: ``{name: {frame name: coefficient}}``, e.g. ``{"engine": {"live_b": 1, "off_b": -1,
    "live_a": -1, "off_a": 1}}``. Prompts missing from a frame, failed or without a verify step are left out of all.

    Returns ``{name: {"delta", "lo", "hi", "n"}}`` (tokens per verify step; NaN bounds below 2 prompts)."""
    keep = None
    for df in frames.values():
        ok = df[(df["verify_ct"].fillna(0) > 0) & (df["error"].isna() if "error" in df else True)]
        ids = set(ok["prompt_id"].astype(str))
        keep = ids if keep is None else keep & ids
    ids = sorted(keep or ())
    ct, v = {}, {}
    for name, df in frames.items():
        d = df.assign(prompt_id=df["prompt_id"].astype(str)).drop_duplicates("prompt_id").set_index("prompt_id")
        ct[name] = d.loc[ids, "completion_tokens"].to_numpy(float)
        v[name] = d.loc[ids, "verify_ct"].to_numpy(float)
    n = len(ids)
    rng = np.random.default_rng(seed)
    w = rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot).astype(np.float64) if n else np.zeros((0, 0))
    out = {}
    for name, coef in terms.items():
        point = sum(c * ct[f].sum() / v[f].sum() for f, c in coef.items()) if n else float("nan")
        if n >= 2:
            boot = sum(c * (w @ ct[f]) / (w @ v[f]) for f, c in coef.items())
            lo, hi = np.nanpercentile(boot, [50 * (1 - level), 100 - 50 * (1 - level)])
        else:
            lo = hi = float("nan")
        out[name] = {"delta": float(point), "lo": float(lo), "hi": float(hi), "n": n}
    return out


def position_effect(a: pd.DataFrame, b: pd.DataFrame, positions: int, *, n_boot: int = 4000, level: float = 0.95,
                    seed: int = 0) -> list[dict]:
    """Per draft position j (1..``positions``): P(accepted >= j) on each side (verify steps that accepted at least j
    drafts / verify steps, from the per-request histograms) and their difference b - a with a paired bootstrap CI
    (the same resampled prompts on both sides). Prompts are matched on ``prompt_id``; requests without a histogram
    are left out.

    Returns: ``[{"position", "a", "b", "delta", "delta_lo", "delta_hi"}]`` (fractions)."""
    def clean(df: pd.DataFrame) -> pd.DataFrame:
        ok = df["histogram"].notna() & (df["verify_ct"].fillna(0) > 0)
        if "error" in df:
            ok &= df["error"].isna()
        return df.loc[ok, ["prompt_id", "histogram"]].drop_duplicates("prompt_id")
    m = clean(a).merge(clean(b), on="prompt_id", suffixes=("_a", "_b"))
    m = m.assign(_key=m["prompt_id"].astype(str)).sort_values("_key", kind="stable")   # any row order, one CI
    if not len(m):
        return []
    ha = histogram_matrix([_hist(x) for x in m["histogram_a"]], positions + 1)
    hb = histogram_matrix([_hist(x) for x in m["histogram_b"]], positions + 1)
    pa, pb = position_rates(ha.sum(0), positions)[0], position_rates(hb.sum(0), positions)[0]
    rng = np.random.default_rng(seed)
    w = rng.multinomial(len(m), np.full(len(m), 1.0 / len(m)), size=n_boot).astype(np.float64)
    da = position_rates(w @ ha, positions)[0]
    db = position_rates(w @ hb, positions)[0]
    d = db - da
    lo, hi = np.nanpercentile(d, [50 * (1 - level), 100 - 50 * (1 - level)], axis=0) if len(m) >= 2 else \
        (np.full(positions, np.nan), np.full(positions, np.nan))
    return [{"position": j + 1, "a": float(pa[j]), "b": float(pb[j]), "delta": float(pb[j] - pa[j]),
             "delta_lo": float(lo[j]), "delta_hi": float(hi[j])} for j in range(positions)]


def _hist(x: Any) -> list[int]:
    return [int(v) for v in (json.loads(x) if isinstance(x, str) else x)]


def _stage_repeat(p: Pair) -> None:
    """Each server asked one greedy request twice (:func:`helpers.acceptance.requests.repeatability`): a server whose
    answers move between calls is said, since its side of the comparison would too."""
    first = load_prompts(None, n=1)[0]
    p.doc["repeatable"] = {}
    for s in (p.a, p.b):
        rep = repeatability(s.client, first, max_new_tokens=p.max_new_tokens)
        p.doc["repeatable"][s.label] = rep["same"]
        if rep["note"]:
            p.doc.setdefault("notes", []).append(f"server {s.label}: {rep['note']}")


def _stage_paired(p: Pair) -> None:
    """The live answers paired per prompt: accept length and per-position acceptance."""
    e = paired_effect(p.a.live, p.b.live)
    k = max(int(p.a.att.spec.get("num_steps") or 1), int(p.b.att.spec.get("num_steps") or 1))
    pos = position_effect(p.a.live, p.b.live, k)
    p.doc["live"] = {"effect": e, "positions": pos, "prompts": p.prompts, "max_new_tokens": p.max_new_tokens,
                     "accept_length": {s.label: _live_al(s.live) for s in (p.a, p.b)}}
    p.progress(f"paired over {e['n_paired']} prompts: accept length b - a {e['accept_length_delta']:+.2f} "
               f"[{e['accept_length_delta_lo']:+.2f}, {e['accept_length_delta_hi']:+.2f}]")


def _live_al(live: pd.DataFrame) -> Optional[float]:
    ok = live[live["verify_ct"].fillna(0) > 0]
    return float(ok["completion_tokens"].sum() / ok["verify_ct"].sum()) if len(ok) else None


def _stage_attribute(p: Pair) -> None:
    """The live difference decomposed on the live prompts, paired per prompt: **wiring** = the draft run offline on
    b's served states minus on a's (the same draft, the same tokens, a's loader rules: what the states each engine fed
    cost); **engine** = (b's live minus its offline run) minus (a's): what each engine loses after the capture point;
    **draft** = on b's states, b's loader rules minus a's (the tensors each engine runs the draft with);
    **settings** and **draft** when the servers run other settings or another draft. A live difference beyond its CI
    is named with each term whose CI excludes 0 in its direction. The budget's own stage losses (training tokens) are
    kept beside them."""
    frames = {"live_a": p.a.live, "live_b": p.b.live, "off_a": p.a.offline, "off_b": p.b.offline,
              "off_ba": p.b.offline if p.b_as_a is None else p.b_as_a}
    t = paired_terms(frames, {"live": {"live_b": 1, "live_a": -1}, "wiring": {"off_ba": 1, "off_a": -1},
                              "engine": {"live_b": 1, "off_b": -1, "live_a": -1, "off_a": 1},
                              "draft": {"off_b": 1, "off_ba": -1}})
    e = t["live"]
    beyond = math.isfinite(e["lo"]) and (e["lo"] > 0 or e["hi"] < 0)
    sign = 0 if not beyond else (1 if e["lo"] > 0 else -1)
    same_tokens = sum(1 for k, v in p.a.tokens.items() if p.b.tokens.get(k) == v)
    rows, named = [], []
    for stage in STAGES:
        row: dict[str, Any] = {"stage": stage, "differs": False,
                               "budget_loss": {s.label: _loss(s.budget, stage) for s in (p.a, p.b)}}
        if stage in t:
            row.update(t[stage])
            row["differs"] = bool(math.isfinite(t[stage]["lo"]) and (t[stage]["lo"] > 0 or t[stage]["hi"] < 0)
                                  and (sign == 0 or np.sign(t[stage]["delta"]) == sign))
        elif stage == "settings":
            row["settings"] = {"a": p.a.att.spec, "b": p.b.att.spec}
            row["differs"] = p.a.att.spec != p.b.att.spec
        if stage == "draft" and not p.doc.get("same_draft", True):
            row["differs"] = True
        rows.append(row)
        if row["differs"] and beyond:
            named.append(stage)
    p.doc.update(stages=rows, named=named, beyond_ci=beyond, terms=t,
                 same_continuations={"prompts": len(p.a.tokens), "equal": same_tokens})
    if same_tokens < len(p.a.tokens):
        p.doc.setdefault("notes", []).append(
            f"{len(p.a.tokens) - same_tokens} of {len(p.a.tokens)} prompts got another greedy continuation on the two "
            "servers (target numerics): the wiring term compares other tokens there")
    p.doc["sentence"] = _sentence(p, e, named, beyond)


def _loss(b: dict, stage: str) -> Optional[dict]:
    x = (b.get("losses") or {}).get(stage)
    return {k: x.get(k) for k in ("delta", "ci", "decision")} if x and x.get("delta") is not None else None


def _sentence(p: Pair, e: dict, named: list, beyond: bool) -> str:
    al = p.doc["live"]["accept_length"]
    head = (f"{p.b.name()} accepts {al['b']:.2f} tokens per verify step where {p.a.name()} accepts {al['a']:.2f} on "
            f"the same {e['n']} prompts (paired change {e['delta']:+.2f} [{e['lo']:+.2f}, {e['hi']:+.2f}])")
    if not beyond:
        return head + ": no difference beyond the CI."
    if not named:
        return head + ": beyond the CI, but no stage's term is (undecided: more prompts settle it)."
    words = {"wiring": "the states each engine feeds the draft (the draft run offline on them, same tokens)",
             "engine": "what each engine loses after the capture point (live vs the draft offline on its own states)",
             "settings": "the speculative settings",
             "draft": "the draft each server loads (its checkpoint, and the tensors each engine's loader runs it "
                      "with: embedding, lm_head, d2t, norms; the draft run offline on b's states both ways)"}
    parts = []
    for stage in named:
        r = next(x for x in p.doc["stages"] if x["stage"] == stage)
        ci = f" {r['delta']:+.2f} [{r['lo']:+.2f}, {r['hi']:+.2f}]" if "delta" in r else ""
        parts.append(f"{stage}{ci}: {words[stage]}")
    return head + ": it comes from " + "; ".join(parts) + "."


def compare_engines(url_a: str, url_b: str, *, training: str | Path, run_dir: str | Path, prompts: int = 16,
                    max_new_tokens: int = 32, num_samples: int = 4, api_key: Optional[str] = None,
                    timeout: Optional[float] = 1800.0, target: Optional[str | Path] = None,
                    progress: Progress = lambda s: None) -> dict:
    """Compare the servers at ``url_a`` and ``url_b`` (module docstring) and write ``results/compare-engines.json``.

    Args:
        url_a / url_b: the two servers (any engine this tool knows; typically the same draft on SGLang and vLLM).
        training: the draft's training data (the wiring stage's tokens).
        run_dir: the run folder (new; ``dumps/a``, ``dumps/b``, ``sides/a``, ``sides/b``, ``results/``).
        prompts / max_new_tokens: the live prompts (the bundled set, the same on both) and tokens per prompt.
        num_samples: training samples for the wiring stage.
        api_key: the servers' API key (never written).
        timeout: the one budget of the run (seconds).
        target: the target folder read here for a server whose own ``model_path`` is not readable (``--target``).

    Returns: ``{"a", "b" (engine, version, url, draft, spec, budget stages and losses), "same_draft", "live":
    {"effect" (paired accept length / rate change b - a with CIs), "positions" ([{position, a, b, delta, delta_lo,
    delta_hi}]: P(accepted >= j)), "accept_length"}, "same_target", "stages" ([{stage, a, b, differs}]), "named",
    "beyond_ci",
    "sentence", "notes", "wall_s"}``.

    Raises:
        BadInput: a server that is neither SGLang nor a known vLLM, unreadable training data, a run folder that
            holds a comparison already, a target not readable here (``--a`` / ``--b``: pass ``target``), two servers
            serving different targets (:func:`check_targets`). ServerError: a server failed or the budget ran out.
    """
    run_dir = Path(run_dir)
    if (run_dir / "results" / "compare-engines.json").exists():
        raise BadInput("the run folder holds a comparison already; compare into a new run folder", path=run_dir)
    p = Pair(a=Side("a", url_a), b=Side("b", url_b), training=Path(training), run_dir=run_dir, prompts=prompts,
             max_new_tokens=max_new_tokens, num_samples=num_samples, dl=Budget(timeout), progress=progress)
    t0 = time.monotonic()
    try:
        _stage_attach(p, api_key, None if target is None else Path(target))
        _stage_budget(p)
        _stage_repeat(p)
        _stage_paired(p)
        _stage_attribute(p)
    finally:
        for s in (p.a, p.b):
            if s.client is not None:
                s.client.close()
    for s in (p.a, p.b):
        p.doc[s.label] = {"engine": s.adapter.name, "label": s.adapter.label, "version": s.att.version,
                          "url": s.url, "tp": s.att.tp, "draft": str(s.att.draft_dir), "spec": s.att.spec,
                          "budget": {k: s.budget.get(k) for k in ("stages", "losses", "cause", "sentence")}}
    p.doc["wall_s"] = round(time.monotonic() - t0, 1)
    write_json(run_dir / "results" / "compare-engines.json", p.doc)
    return p.doc
