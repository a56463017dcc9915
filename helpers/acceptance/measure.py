"""One acceptance measurement of a live server: requests, summary with CIs, per-position curves, the server's
effective settings; saved as ``summary.json``, ``per_request.parquet``, ``positions.csv``.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import math
import os
import shlex
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import pandas as pd
from pydantic import ValidationError

from ..errors import BadInput, SGLangError
from ..runfiles import (atomic_write_bytes, atomic_write_text, parquet_bytes, read_json_file, safe_name,
                        safetensors_fingerprint, staged_folder)
from ..server.client import ServerClient, as_client
from ..redaction import redact, redact_argv, redact_command, redact_url
from ..server.settings import EffectiveSpecConfig
from .ledger import Ledger, LedgerUnreadable
from .machine import LoadSampler
from .prompts import Prompt, load_prompts, prompts_digest
from .requests import run_requests
from .workload import describe as describe_workload
from .stats import (
    accepted_drafts,
    bootstrap_mean_ci,
    bootstrap_positions_ci,
    bootstrap_ratio_ci,
    format_ci,
    histogram_matrix,
)


def summarize(per_request: pd.DataFrame, *, positions: Optional[int], wall_s: float = float("nan"),
              n_boot: int = 2000, level: float = 0.95, seed: int = 0
              ) -> tuple[dict, pd.DataFrame, np.ndarray, list[str]]:
    """Totals, CIs and per-position curves from a per-request frame (:func:`run_requests`).

    ``positions``: draft positions k (``num_steps``; None: from the longest histogram).
    Returns ``(summary, positions_df, summed_histogram, warnings)``. Requests with an error are
    left out; requests without spec fields are left out of the spec figures and counted in
    ``n_missing_spec`` (a warning says so).
    """
    warn: list[str] = []
    ok = per_request[per_request["error"].isna()]
    n_err = int(len(per_request) - len(ok))
    if n_err:
        warn.append(f"{failed_requests(per_request)} and were left out")
    spec = ok[ok["has_spec"].astype(bool)]
    n_missing = int(len(ok) - len(spec))
    s: dict[str, Any] = {"n_requests": int(len(ok)), "n_failed": n_err, "n_spec": int(len(spec)),
                         "n_missing_spec": n_missing, "ci_level": level, "n_boot": n_boot}
    comp = ok["completion_tokens"].to_numpy(float)
    lat = ok["latency_s"].to_numpy(float)
    s["completion_tokens"] = int(np.nansum(comp)) if len(ok) else 0
    s["prompt_tokens"] = int(np.nansum(ok["prompt_tokens"].to_numpy(float))) if len(ok) else 0
    s["wall_s"] = float(wall_s)
    s["throughput_tok_s"] = (s["completion_tokens"] / wall_s) if wall_s and wall_s > 0 else float("nan")
    if len(ok):
        s["tok_s"], s["tok_s_lo"], s["tok_s_hi"] = bootstrap_ratio_ci(comp, lat, n_boot=n_boot,
                                                                      level=level, seed=seed)
        s["latency_mean_s"], s["latency_mean_s_lo"], s["latency_mean_s_hi"] = bootstrap_mean_ci(
            lat, n_boot=n_boot, level=level, seed=seed)
        s["latency_p50_s"] = float(np.nanquantile(lat, 0.5))
        s["latency_p90_s"] = float(np.nanquantile(lat, 0.9))
        e2e = ok["e2e_latency_s"].to_numpy(float)
        s["server_e2e_latency_mean_s"] = float(np.nanmean(e2e)) if np.isfinite(e2e).any() else float("nan")
        with np.errstate(invalid="ignore", divide="ignore"):
            s["client_overhead_frac"] = (float(np.nanmean((lat - e2e) / lat))
                                         if np.isfinite(e2e).any() else float("nan"))
    else:
        for k in ("tok_s", "tok_s_lo", "tok_s_hi", "latency_mean_s", "latency_mean_s_lo",
                  "latency_mean_s_hi", "latency_p50_s", "latency_p90_s", "server_e2e_latency_mean_s",
                  "client_overhead_frac"):
            s[k] = float("nan")

    nan = float("nan")
    if len(spec):
        num = spec["completion_tokens"].to_numpy(float)
        ver = spec["verify_ct"].to_numpy(float)
        s["verify_steps"] = int(ver.sum())
        s["accept_length"], s["accept_length_lo"], s["accept_length_hi"] = bootstrap_ratio_ci(
            num, ver, n_boot=n_boot, level=level, seed=seed)
        (s["accept_length_mean_of_ratios"], s["accept_length_mean_of_ratios_lo"],
         s["accept_length_mean_of_ratios_hi"]) = bootstrap_mean_ci(num / ver, n_boot=n_boot,
                                                                  level=level, seed=seed)
        cor = spec["correct_drafts"].to_numpy(float)
        prop = spec["proposed_drafts"].to_numpy(float)
        s["correct_drafts"], s["proposed_drafts"] = int(np.nansum(cor)), int(np.nansum(prop))
        s["accept_rate"], s["accept_rate_lo"], s["accept_rate_hi"] = bootstrap_ratio_ci(
            cor, prop, n_boot=n_boot, level=level, seed=seed)
        hists = [json.loads(h) if isinstance(h, str) else None for h in spec["histogram"]]
        if any(h is None for h in hists):
            warn.append(f"{sum(h is None for h in hists)} answers carry spec_verify_ct but no "
                        "spec_correct_drafts_histogram (SGLang before #18332?): per-position "
                        "acceptance uses the others only")
        have = [h for h in hists if h is not None]
        k = positions if positions is not None else max([len(h) - 1 for h in have] + [0])
        mat = histogram_matrix(have, k + 1) if have else np.zeros((0, k + 1), dtype=np.int64)
        if mat.shape[1] > k + 1:
            warn.append(f"histograms have {mat.shape[1] - 1} positions but num_steps is {k}")
            k = mat.shape[1] - 1
        hist = mat.sum(axis=0)
        pos = bootstrap_positions_ci(mat, k, n_boot=n_boot, level=level, seed=seed) if len(have) else \
            pd.DataFrame(columns=["position", "marginal", "marginal_lo", "marginal_hi",
                                  "conditional", "conditional_lo", "conditional_hi"])
        S, A = int(hist.sum()), accepted_drafts(hist)
        s["hist_verify_steps"], s["hist_accepted_drafts"] = S, A
        if have:
            w = np.array([accepted_drafts(h) for h in have], float)
            st = np.array([sum(h) for h in have], float)
            s["accept_length_hist"], s["accept_length_hist_lo"], s["accept_length_hist_hi"] = (
                bootstrap_ratio_ci(w + st, st, n_boot=n_boot, level=level, seed=seed))
        else:
            s["accept_length_hist"] = s["accept_length_hist_lo"] = s["accept_length_hist_hi"] = nan
        # consistency of SGLang's own counters (a mismatch means a parsing / version problem)
        hv = spec["histogram"].notna()
        bad_steps = (spec.loc[hv, "verify_ct"].to_numpy() !=
                     np.array([sum(json.loads(h)) for h in spec.loc[hv, "histogram"]])).sum()
        bad_acc = (spec.loc[hv, "correct_drafts"].to_numpy() != spec.loc[hv, "hist_correct_drafts"]
                   .to_numpy()).sum()
        if bad_steps or bad_acc:
            warn.append(f"histogram disagrees with spec_verify_ct in {bad_steps} and with "
                        f"spec_num_correct_drafts in {bad_acc} answers")
        s["positions"] = int(k)
    else:
        hist = np.zeros(1 if positions is None else positions + 1, dtype=np.int64)
        pos = pd.DataFrame(columns=["position", "marginal", "marginal_lo", "marginal_hi",
                                    "conditional", "conditional_lo", "conditional_hi"])
        for key in ("accept_length", "accept_length_lo", "accept_length_hi",
                    "accept_length_mean_of_ratios", "accept_length_mean_of_ratios_lo",
                    "accept_length_mean_of_ratios_hi", "accept_rate", "accept_rate_lo",
                    "accept_rate_hi", "accept_length_hist", "accept_length_hist_lo",
                    "accept_length_hist_hi"):
            s[key] = nan
        s.update(verify_steps=0, correct_drafts=0, proposed_drafts=0, hist_verify_steps=0,
                 hist_accepted_drafts=0, positions=positions)
    if n_missing:
        warn.append(f"{n_missing} of {len(ok)} answers have no spec fields (spec_verify_ct absent): "
                    "they are set only on the final chunk and only when the request verified at "
                    "least once (max_new_tokens=1 or an immediate stop never verifies); they are "
                    "left out of the accept figures")
    return s, pos, hist, warn


def failed_requests(per_request: pd.DataFrame) -> Optional[str]:
    """One line for the requests of a measurement that failed -- ``3 of 8 requests failed (first: prompt p003: POST
    .../generate (request 9f..): impossible spec counters: identity '...' broken: ...)`` -- or None when none did.
    What ``measure`` says when it exits 1 for failed requests, and the summary's warning."""
    bad = per_request[per_request["error"].notna()]
    if not len(bad):
        return None
    return (f"{len(bad)} of {len(per_request)} requests failed (first: prompt {bad['prompt_id'].iloc[0]}: "
            f"{bad['error'].iloc[0]})")


@dataclasses.dataclass
class AcceptanceResult:
    """Outcome of :func:`measure`.

    Attributes:
        summary: dict of totals and CIs (keys documented in the module docstring and
            :func:`summarize`; plus ``label``, ``url``, spec settings, ``baseline_tok_s``,
            ``speedup``, ``config_digest``, ``prompt_digest``).
        per_request: one row per request (:data:`PER_REQUEST_COLUMNS`).
        positions: per-position marginal / conditional rates with CIs (one row per position).
        histogram: summed correct-drafts histogram ``[num_steps + 1]`` (int64).
        spec: the server's :class:`~helpers.server.settings.EffectiveSpecConfig` (None if unavailable).
        server: redacted ``/server_info`` snapshot (no ``internal_states``, no secrets).
        warnings: human-readable caveats (missing spec fields, overrides, failures).
        baseline: summary of the baseline (target-only) run, when one was given.
        raw: per-request ``{"output_ids", "meta_info"}`` when ``keep_raw=True``.
    """

    summary: dict
    per_request: pd.DataFrame
    positions: pd.DataFrame
    histogram: np.ndarray
    spec: Optional[EffectiveSpecConfig] = None
    server: dict = dataclasses.field(default_factory=dict)
    warnings: list = dataclasses.field(default_factory=list)
    baseline: Optional[dict] = None
    raw: Optional[list] = None

    def summary_frame(self) -> pd.DataFrame:
        """The summary as a one-row DataFrame."""
        return pd.DataFrame([{k: v for k, v in self.summary.items()
                              if not isinstance(v, (list, dict))}])

    def ledger_row(self, fix: Optional[str] = None) -> dict:
        """Flat row for :class:`helpers.acceptance.ledger.Ledger` (lists/dicts as JSON strings)."""
        row = {}
        for k, v in self.summary.items():
            row[k] = json.dumps(v) if isinstance(v, (list, dict)) else v
        row["fix"] = fix or self.summary.get("label") or "unnamed"
        row["histogram_json"] = json.dumps([int(x) for x in self.histogram])
        row["positions_json"] = self.positions.to_json(orient="records")
        row["warnings_json"] = json.dumps(self.warnings)
        row["overrides_json"] = json.dumps([o.model_dump() for o in self.spec.overrides]
                                           if self.spec else [])
        return row

    def record(self, run_dir: Path | str, fix: str, *, under: str = "fixes", **row: Any) -> Path:
        """Save this measurement into ``run_dir/<under>/<fix>`` (:meth:`save`: ``-2``, ``-3``, ... when taken) and
        append its ledger row (:meth:`ledger_row` with ``saved_to`` and ``row``) to ``run_dir/ledger.parquet``: the
        one way a measurement joins a ledger (``measure``, ``measure --fixes``, the replay and the acceptance page).

        The row's identity (``fix``, ``row_id``, ``appended_at``, ``writer_pid`` and ``row``) is written into
        ``summary.json`` (key ``ledger``) too, so the measurement folders hold everything the ledger indexes
        (:func:`rebuild_ledger`). When this process fails to append the row (a full disk, a signal), the folder
        just saved is removed again, so no measurement is left without its row; when the ledger that was there
        cannot be read, the measurement is **kept** (another file's state never deletes it) and
        :class:`~helpers.acceptance.ledger.LedgerUnreadable` says where it is and how to rebuild the ledger.

        Args:
            run_dir: the run folder. fix: the fix's name (folder name via :func:`helpers.runfiles.safe_name`).
            under: the folder of the run folder the measurement goes in (``fixes``; ``acceptance`` for the replay
                and the notebook pages). row: more ledger columns (e.g. ``error=None``).

        Returns: the measurement's folder.

        Raises:
            LedgerUnreadable: the run folder's ledger cannot be read (exit 2); the measurement was kept.
            OSError: a file could not be written (the message names it); nothing of this measurement is left.
        """
        run_dir = Path(run_dir)
        entry = {"fix": fix, "row_id": uuid.uuid4().hex, "appended_at": pd.Timestamp.now(tz="UTC").isoformat(),
                 "writer_pid": os.getpid(), **row}
        saved = self.save(run_dir / under / safe_name(fix), ledger=entry)
        rel = str(saved.relative_to(run_dir))
        try:
            full = self.ledger_row(fix)
            full.update(entry)
            full["saved_to"] = rel
            Ledger(run_dir / "ledger.parquet").append(full)
        except LedgerUnreadable as exc:
            raise LedgerUnreadable(exc.path, exc.reason, kept=rel) from None
        except BaseException:
            shutil.rmtree(saved, ignore_errors=True)
            raise
        return saved

    def save(self, folder: Path | str, *, ledger: Optional[Mapping[str, Any]] = None) -> Path:
        """Write ``summary.json``, ``per_request.parquet``, ``positions.csv`` (and ``raw_meta.json``) as one unit
        into a new folder and return it: ``folder`` itself when it does not exist yet, else ``folder-2``,
        ``folder-3``, ... -- a measurement is never overwritten, and two runs saving under one label at once get
        one folder each (the files are written into a temporary folder next to it,
        :func:`helpers.runfiles.staged_folder`, which is then renamed into place: ``rename`` of a folder onto a name
        that exists fails, so the loser takes the next suffix). ``ledger``: the ledger row's identity
        (:meth:`record`), stored in ``summary.json``.

        Raises:
            OSError: the folder cannot be written (e.g. ENOSPC), naming the file under ``folder`` (never the
                temporary folder's); the temporary folder is removed.
        """
        folder = Path(folder)
        with staged_folder(folder) as tmp:
            doc = {"summary": self.summary, "warnings": self.warnings,
                   "histogram": [int(x) for x in self.histogram],
                   "positions": json.loads(self.positions.to_json(orient="records")),
                   "spec": self.spec.model_dump() if self.spec else None, "baseline": self.baseline,
                   "server": self.server}
            if ledger is not None:
                doc["ledger"] = dict(ledger)
            atomic_write_text(tmp / "summary.json", json.dumps(doc, indent=1, default=_json_default))
            atomic_write_bytes(tmp / "per_request.parquet", parquet_bytes(self.per_request))
            atomic_write_text(tmp / "positions.csv", self.positions.to_csv(index=False))
            if self.raw is not None:
                atomic_write_text(tmp / "raw_meta.json", json.dumps(self.raw, default=_json_default))
            for i in range(1, 10000):
                dest = folder if i == 1 else folder.with_name(f"{folder.name}-{i}")
                try:
                    os.rename(tmp, dest)        # atomic; fails when dest exists and is not empty
                    return dest
                except OSError as exc:
                    if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
                        raise
                    if dest.exists() and dest.is_dir() and not any(dest.iterdir()):
                        dest.rmdir()            # an empty folder left by someone: take its name
                        os.rename(tmp, dest)
                        return dest
            raise OSError(errno.EEXIST, "no free folder name", str(folder))
        raise AssertionError("unreachable")     # pragma: no cover - the block returns or raises

    @classmethod
    def from_summary(cls, folder: Path | str) -> tuple["AcceptanceResult", dict]:
        """A saved measurement read back from its ``summary.json`` (:meth:`save`): summary, warnings, histogram,
        positions, spec, baseline, server; ``per_request`` is left empty (read ``per_request.parquet`` for it).
        Returns ``(result, doc)`` (``doc``: the parsed file, with ``ledger`` when :meth:`record` saved it).

        Raises:
            BadInput: no ``summary.json``, not JSON, or not a measurement (no ``summary`` object, a histogram that
                is not a list of counts, positions that are not a list, a spec that is not this tool's), naming the
                file and the field.
        """
        path = Path(folder) / "summary.json"
        doc = read_json_file(path, "measurement summary", expected="the summary.json a measurement saves")
        if not isinstance(doc, dict) or not isinstance(doc.get("summary"), dict):
            raise BadInput("not a measurement summary (expected an object with a 'summary' object)", path=path,
                           field="summary")
        hist = doc.get("histogram") or []
        if not isinstance(hist, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in hist):
            raise BadInput("expected a list of counts", path=path, field="histogram")
        positions = doc.get("positions") or []
        if not isinstance(positions, list) or not all(isinstance(r, dict) for r in positions):
            raise BadInput("expected a list of per-position objects", path=path, field="positions")
        ledger = doc.get("ledger")
        if ledger is not None and not (isinstance(ledger, dict) and isinstance(ledger.get("fix"), str)):
            raise BadInput("expected an object with the fix's name", path=path, field="ledger")
        try:
            spec = EffectiveSpecConfig.model_validate(doc["spec"]) if doc.get("spec") is not None else None
        except ValidationError as exc:
            first = exc.errors()[0]
            raise BadInput(f"{first['msg']} (expected the server's effective spec config)", path=path,
                           field="spec." + ".".join(str(x) for x in first["loc"])) from None
        warnings = doc.get("warnings") or []
        res = cls(summary=doc["summary"], per_request=pd.DataFrame(), positions=pd.DataFrame(positions),
                  histogram=np.asarray(hist, dtype=np.int64), spec=spec,
                  server=doc.get("server") if isinstance(doc.get("server"), dict) else {},
                  warnings=[str(w) for w in warnings] if isinstance(warnings, list) else [str(warnings)],
                  baseline=doc.get("baseline") if isinstance(doc.get("baseline"), dict) else None)
        return res, doc


#: the folders of a run folder whose measurements are ledger rows (:meth:`AcceptanceResult.record`'s ``under``)
LEDGER_FOLDERS = ("fixes", "acceptance")


@dataclasses.dataclass
class RebuiltLedger:
    """What :func:`rebuild_ledger` did: ``path`` the new ledger, ``folders`` the measurement folders it indexes
    (relative to the run folder, in row order), ``skipped`` one line per folder that could not be read (left
    out, untouched), ``kept_old`` where the ledger it replaced was kept (None: there was none)."""

    path: Path
    folders: list
    skipped: list
    kept_old: Optional[Path]


def rebuild_ledger(run_dir: Path | str) -> RebuiltLedger:
    """Rebuild ``run_dir/ledger.parquet`` from the run folder's measurement folders (``python -m helpers measure
    --rebuild-ledger RUN_DIR``): one row per folder of :data:`LEDGER_FOLDERS` saved by
    :meth:`AcceptanceResult.record` (its ``summary.json`` has the row's identity; ``fixes/`` folders saved before
    that are taken too, named by their label), built by :meth:`AcceptanceResult.ledger_row` as when it was
    appended, with ``saved_to`` the folder, ordered by ``appended_at``. Measurements that never were ledger rows
    (an investigation's ``acceptance/before``, ``after``; sweeps under ``ablate/``) are left out. The old ledger,
    readable or not, is kept beside the new one (:meth:`Ledger.rebuild`); rows without a folder (a fix that
    failed before it was measured) are only in that old file.

    Raises:
        BadInput: ``run_dir`` is not a folder.
        OSError: the ledger cannot be written (naming it).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise BadInput("not a run folder (expected the folder holding ledger.parquet and fixes/)", path=run_dir)
    found: list[tuple[str, str, dict]] = []
    skipped: list[str] = []
    for under in LEDGER_FOLDERS:
        base = run_dir / under
        if not base.is_dir():
            continue
        for folder in sorted(base.iterdir()):
            if folder.name.startswith(".") or not folder.is_dir():      # a staging folder of a save in progress
                continue
            if not (folder / "summary.json").exists() and under != "fixes":
                continue
            try:
                res, doc = AcceptanceResult.from_summary(folder)
            except BadInput as exc:
                skipped.append(str(exc))
                continue
            entry = doc.get("ledger")
            if entry is None and under != "fixes":
                continue                                                # a measurement that never was a ledger row
            entry = dict(entry or {"fix": str(res.summary.get("label") or folder.name)})
            row = res.ledger_row(entry["fix"])
            row.update(entry)
            row["saved_to"] = str(folder.relative_to(run_dir))
            found.append((str(entry.get("appended_at") or res.summary.get("timestamp") or ""), row["saved_to"], row))
    found.sort(key=lambda t: (t[0], t[1]))
    ledger = Ledger(run_dir / "ledger.parquet")
    kept = ledger.rebuild([row for _, _, row in found])
    return RebuiltLedger(path=ledger.path, folders=[f for _, f, _ in found], skipped=skipped, kept_old=kept)


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    return str(o)


#: ServerArgs fields that define a fix for the config digest (what changes acceptance or speed).
DIGEST_FIELDS = (
    "model_path", "speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps",
    "speculative_eagle_topk", "speculative_num_draft_tokens", "speculative_accept_threshold_single",
    "speculative_accept_threshold_acc", "speculative_use_rejection_sampling",
    "speculative_attention_mode", "speculative_adaptive", "speculative_token_map",
    "tp_size", "dp_size", "pp_size", "enable_dp_attention", "dtype", "kv_cache_dtype", "quantization",
    "attention_backend", "sampling_backend", "page_size", "max_running_requests",
    "chunked_prefill_size", "disable_radix_cache", "disable_overlap_schedule", "disable_cuda_graph",
    "enable_return_hidden_states", "forward_hooks", "json_model_override_args", "context_length",
    "revision", "speculative_draft_model_revision", "device", "version")


def server_config(info: Mapping[str, Any]) -> dict:
    """The subset of a (redacted) ``/server_info`` that defines a fix (:data:`DIGEST_FIELDS`)."""
    return {k: info.get(k) for k in DIGEST_FIELDS}


def config_digest(info: Mapping[str, Any]) -> str:
    """sha256 (16 hex) of :func:`server_config` as canonical JSON; no secrets go in."""
    cfg = redact(server_config(info))
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]


def server_snapshot(info: Mapping[str, Any]) -> dict:
    """Redacted ``/server_info`` without the bulky, volatile ``internal_states``."""
    return {k: v for k, v in redact(info).items() if k != "internal_states"}


#: the highest sampling temperature a measurement takes (SGLang refuses a negative one and takes any finite one; past
#: a few the draft's acceptance is noise)
MAX_TEMPERATURE = 10.0
#: the fewest bootstrap resamples behind a CI (as a fixes file's ``n_boot``)
MIN_BOOT = 100


def check_settings(*, max_new_tokens: Optional[int] = None, temperature: Optional[float] = None,
                   n_boot: Optional[int] = None, warmup: Optional[int] = None) -> None:
    """The one check of a measurement's settings (``measure``, ``ablate``), given or not, before any request:
    ``max_new_tokens`` >= 1, ``temperature`` finite in [0, :data:`MAX_TEMPERATURE`] (a NaN or inf cannot even be
    sent as JSON), ``n_boot`` >= :data:`MIN_BOOT`, ``warmup`` >= 0.

    Raises:
        BadInput: the first setting out of range, naming its command-line flag."""
    if max_new_tokens is not None and not max_new_tokens >= 1:
        raise BadInput(f"max_new_tokens must be >= 1, got {max_new_tokens}", field="--max-new-tokens")
    if temperature is not None and not 0 <= temperature <= MAX_TEMPERATURE:
        raise BadInput(f"expected a temperature in [0, {MAX_TEMPERATURE:g}], got {temperature}", field="--temperature")
    if n_boot is not None and not n_boot >= MIN_BOOT:
        raise BadInput(f"expected at least {MIN_BOOT} bootstrap resamples, got {n_boot}", field="--bootstrap")
    if warmup is not None and not warmup >= 0:
        raise BadInput(f"expected warm-up requests >= 0, got {warmup}", field="--warmup")


def provenance(client: ServerClient, info: Mapping[str, Any], command: Optional[Sequence[str] | str] = None,
               draft_checksum: Optional[Callable[[ServerClient], Optional[dict]]] = None) -> dict:
    """Where a measurement comes from, recorded beside it (``summary["provenance"]``): ``command`` (the tool's
    command line as typed, ``sys.argv`` unless given, secrets redacted), ``launch_command`` (the server's launch flags
    from ``/server_info``, redacted; None when the engine does not report it), ``draft_path``, ``draft_checksum``
    (the engine's hash of the served draft weights: ``draft_checksum(client)``, the engine adapter's
    :meth:`helpers.engines.base.EngineAdapter.draft_checksum`, SGLang 0.5.23 ``POST /weights_checker``
    ``per_engine_checksum``; None where the engine has none or no adapter was given, with ``draft_checksum_why``),
    and ``draft_files`` (``{file: sha256 of its safetensors header and first MiB}``,
    :func:`helpers.runfiles.safetensors_fingerprint`, when the draft folder is readable here).

    Never raises for a missing piece: each is None with a ``*_why`` reason."""
    argv = sys.argv if command is None else command
    if command is None and argv and Path(argv[0]).name == "__main__.py" and Path(argv[0]).parent.name == "helpers":
        argv = ["python", "-m", "helpers", *argv[1:]]             # what was typed
    red = redact(dict(info))
    out: dict[str, Any] = {"command": redact_command(argv) if isinstance(argv, str) else " ".join(
        shlex.quote(a) for a in redact_argv(list(argv))), "launch_command": red.get("launch_command"),
        "draft_path": info.get("speculative_draft_model_path"), "draft_checksum": None, "draft_files": None}
    try:
        if draft_checksum is None:
            raise ValueError("no engine adapter given to ask the engine for its draft checksum")
        ck = draft_checksum(client)
        out["draft_checksum"] = None if ck is None else ck.get("per_engine_checksum")
        if ck is None:
            out["draft_checksum_why"] = "the engine has no draft-weights checksum endpoint"
        else:
            out["draft_checksum_source"] = ck.get("source")
    except (SGLangError, BadInput, ValueError) as exc:
        out["draft_checksum_why"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    d = info.get("speculative_draft_model_path")
    try:
        files = sorted(Path(d).glob("*.safetensors")) if d and Path(d).is_dir() else []
        out["draft_files"] = {f.name: safetensors_fingerprint(f) for f in files} or None
    except OSError as exc:
        out["draft_files_why"] = str(exc)[:200]
    if not out["draft_files"] and "draft_files_why" not in out:
        out["draft_files_why"] = "the draft folder is not readable here" if d else "the server runs no draft"
    return out


def measure(client_or_url: "ServerClient | str | Any", prompts: Any = None, max_new_tokens: int = 128,
            concurrency: int = 1, *, num_prompts: Optional[int] = None,
            sampling_params: Optional[Mapping[str, Any]] = None, temperature: float = 0.0,
            ignore_eos: bool = False, api_key: Optional[str] = None, baseline: Any = None,
            warmup: int = 1, flush_cache: bool = True, n_boot: int = 2000, level: float = 0.95,
            seed: int = 0, return_hidden_states: bool = False, progress: bool = True,
            label: Optional[str] = None, requested: Any = None, keep_raw: bool = False,
            draft_config: Any = None, requests: Optional[Sequence[Any]] = None,
            command: Optional[Sequence[str] | str] = None,
            draft_checksum: Optional[Callable[[ServerClient], Optional[dict]]] = None) -> AcceptanceResult:
    """Measure accept length / accept rate / per-position acceptance / tok/s on a live server.

    Args:
        client_or_url: any engine's :class:`~helpers.server.client.ServerClient`, URL (SGLang), or ``ServerHandle``.
        prompts: None (bundled 48 prompts), a file, or a list (see :func:`load_prompts`;
            training samples via :func:`prompts_from_samples`).
        max_new_tokens: tokens to generate per request (must be >= 2 for any verify step).
        concurrency: requests in flight at once (threads sharing one HTTP client).
        num_prompts: use the first n prompts (cycling when larger than the set).
        sampling_params: extra SGLang sampling params; ``temperature`` / ``ignore_eos`` fill
            their keys unless given there (greedy by default: acceptance is then deterministic
            per prompt; ``ignore_eos=True`` forces full-length answers).
        api_key: used when a URL is given (default ``$SGLANG_API_KEY``).
        baseline: a server without the draft (client / URL / handle) measured with the same
            prompts for ``baseline_tok_s`` and ``speedup``, or a number (tok/s known already).
        warmup: requests sent first and not counted (first-request costs).
        flush_cache: flush before measuring (cold radix cache for every run; this also resets
            ``avg_spec_accept_length``, which is not used here).
        n_boot, level, seed: bootstrap settings.
        return_hidden_states: also request hidden states (to measure capture overhead).
        label: name of the fix (goes into ``summary["label"]``).
        requested: the launch command / args asked for, for the override check
            (:meth:`SGLangClient.effective_spec_config`; default: the server's launch_command).
        keep_raw: keep each answer's ``meta_info`` (``result.raw``).
        draft_config: draft config.json (mapping/path) for the algorithm check.
        requests: the user's requests (:func:`helpers.acceptance.workload.load_requests`), sent instead of
            ``prompts``, each with its own sampling params laid over ``sampling_params`` (its ``max_new_tokens``
            over ``max_new_tokens``); ``summary["workload"]`` describes them (:func:`helpers.acceptance.workload.
            describe`).
        command: the command line recorded in ``summary["provenance"]`` (default ``sys.argv``; :func:`provenance`).
        draft_checksum: the engine adapter's ``draft_checksum`` (``helpers.engines``), for the provenance's draft
            hash (None: recorded as not asked).

    Returns: :class:`AcceptanceResult`. Raises :class:`~helpers.errors.SGLangError` when the
    server cannot be reached or every request failed; :class:`~helpers.errors.BadInput` on bad arguments
    (:func:`check_settings`), before any request.
    """
    check_settings(max_new_tokens=max_new_tokens, temperature=temperature, n_boot=n_boot, warmup=warmup)
    own = not isinstance(client_or_url, ServerClient)
    client = as_client(client_or_url, api_key=api_key)
    try:
        per_sp = None
        if requests is not None:
            plist = [r.prompt for r in requests]
            per_sp = [r.sampling for r in requests]
        else:
            plist = load_prompts(prompts, n=num_prompts)
        sp = dict(sampling_params or {})
        sp.setdefault("temperature", temperature)
        if ignore_eos:
            sp.setdefault("ignore_eos", True)
        info = client.server_info(refresh=True)
        spec: Optional[EffectiveSpecConfig] = None
        warn: list[str] = []
        try:
            spec = client.effective_spec_config(requested, draft_config=draft_config)
        except SGLangError as exc:  # pragma: no cover - model_info missing on exotic servers
            warn.append(f"effective spec config unavailable: {exc}")
        if spec is not None:
            for o in spec.overrides:
                warn.append(f"override: {o.message}")
            warn.extend(spec.notes)
        spec_on = bool(info.get("speculative_algorithm"))
        if not spec_on:
            warn.append("the server runs without speculative decoding: accept length / rate are "
                        "undefined (NaN); tok/s is still measured")
        if max_new_tokens < 2 and spec_on:
            warn.append("max_new_tokens < 2: no request can verify, so no spec fields come back")
        if warmup:
            run_requests(client, plist[:max(1, min(warmup, len(plist)))], max_new_tokens=min(8, max_new_tokens),
                         sampling_params=sp, progress=False)
        if flush_cache:
            client.flush_cache()
        with LoadSampler() as load:     # the machine's load: tok/s is wall-clock speed (helpers.acceptance.machine)
            per_request, wall, raw = run_requests(
                client, plist, max_new_tokens=max_new_tokens, concurrency=concurrency, sampling_params=sp,
                return_hidden_states=return_hidden_states, progress=(f"measure {label}" if label and progress
                                                                     else progress), keep_raw=keep_raw,
                per_request_sampling=per_sp)
        if per_request["error"].notna().all():
            raise SGLangError(failed_requests(per_request), endpoint="/generate")
        positions = info.get("speculative_num_steps") if spec_on else None
        s, pos, hist, w2 = summarize(per_request, positions=positions, wall_s=wall, n_boot=n_boot,
                                     level=level, seed=seed)
        warn.extend(w2)
        s.update({
            "label": label, "url": redact_url(client.url), "engine": info.get("engine", "sglang"),
            "sglang_version": info.get("sglang_version", info.get("version")), "engine_version": info.get("version"),
            "algorithm": info.get("speculative_algorithm"), "num_steps": info.get("speculative_num_steps"),
            "topk": info.get("speculative_eagle_topk"),
            "num_draft_tokens": info.get("speculative_num_draft_tokens"), "tp_size": info.get("tp_size"),
            "draft_model_path": info.get("speculative_draft_model_path"),
            "model_path": info.get("model_path"),
            "max_new_tokens": int(max_new_tokens), "concurrency": int(concurrency),
            "temperature": sp.get("temperature"), "ignore_eos": bool(sp.get("ignore_eos", False)),
            "return_hidden_states": bool(return_hidden_states), "num_prompts": len(plist),
            "prompt_digest": prompts_digest(plist), "config_digest": config_digest(info),
            "overrides": [o.field for o in spec.overrides] if spec else [],
            "timestamp": pd.Timestamp.now(tz="UTC").isoformat(), "machine": load.result,
            "provenance": provenance(client, info, command, draft_checksum),
        })
        if requests is not None:
            s["workload"] = describe_workload(requests, per_request)
            s["temperature"] = s["workload"]["temperature"]["median"] if s["workload"]["temperature"] else None
            s["max_new_tokens"] = int(s["workload"]["max_new_tokens"]["median"])
        base_summary = None
        s["baseline_tok_s"] = s["baseline_tok_s_lo"] = s["baseline_tok_s_hi"] = float("nan")
        if baseline is not None:
            if isinstance(baseline, (int, float)):
                s["baseline_tok_s"] = float(baseline)
            else:
                bclient = as_client(baseline, api_key=api_key if not isinstance(baseline, ServerClient)
                                    else None)
                try:
                    base_summary = measure_baseline(bclient, plist, max_new_tokens=max_new_tokens,
                                                    concurrency=concurrency, sampling_params=sp,
                                                    warmup=warmup, n_boot=n_boot, level=level, seed=seed,
                                                    progress=progress)
                finally:
                    if not isinstance(baseline, ServerClient):
                        bclient.close()
                s["baseline_tok_s"] = base_summary["tok_s"]
                s["baseline_tok_s_lo"] = base_summary["tok_s_lo"]
                s["baseline_tok_s_hi"] = base_summary["tok_s_hi"]
        s["speedup"] = (s["tok_s"] / s["baseline_tok_s"]
                        if s["baseline_tok_s"] and np.isfinite(s["baseline_tok_s"]) else float("nan"))
        return AcceptanceResult(summary=s, per_request=per_request, positions=pos, histogram=hist,
                                spec=spec, server=server_snapshot(info), warnings=warn,
                                baseline=base_summary, raw=raw if keep_raw else None)
    finally:
        if own:
            client.close()


def measure_baseline(client: ServerClient, prompts: Sequence[Prompt], *, max_new_tokens: int,
                     concurrency: int = 1, sampling_params: Optional[Mapping[str, Any]] = None,
                     warmup: int = 1, n_boot: int = 2000, level: float = 0.95, seed: int = 0,
                     progress: bool = True) -> dict:
    """tok/s of a server without the draft on the same prompts (``summary``-style dict).

    Warns (in ``warnings``) when that server does run speculative decoding after all.
    """
    info = client.server_info(refresh=True)
    if warmup:
        run_requests(client, list(prompts[:max(1, warmup)]), max_new_tokens=min(8, max_new_tokens),
                     sampling_params=sampling_params, progress=False)
    df, wall, _ = run_requests(client, prompts, max_new_tokens=max_new_tokens, concurrency=concurrency,
                               sampling_params=sampling_params,
                               progress="baseline" if progress else False)
    s, _, _, w = summarize(df, positions=None, wall_s=wall, n_boot=n_boot, level=level, seed=seed)
    if info.get("speculative_algorithm"):
        w.append(f"the baseline server runs speculative decoding ({info['speculative_algorithm']})")
    keep = ("n_requests", "completion_tokens", "wall_s", "throughput_tok_s", "tok_s", "tok_s_lo",
            "tok_s_hi", "latency_mean_s", "latency_p50_s", "latency_p90_s")
    out = {k: s[k] for k in keep}
    out.update(url=redact_url(client.url), config_digest=config_digest(info), warnings=w)
    return out


SUMMARY_COLUMNS = ("label", "n_requests", "accept_length", "accept_length_lo", "accept_length_hi",
                   "accept_rate", "accept_rate_lo", "accept_rate_hi", "tok_s", "tok_s_lo", "tok_s_hi",
                   "baseline_tok_s", "speedup", "latency_mean_s", "num_steps", "topk",
                   "num_draft_tokens", "config_digest")


def format_summary(summary: Mapping[str, Any]) -> str:
    """Human-readable lines of the main figures with their CIs."""
    def f(k, nd=3):
        return format_ci(summary, k, digits=nd, missing="n/a")
    lvl = int(round(100 * summary.get("ci_level", 0.95)))
    lines = [
        f"fix: {summary.get('label') or '-'}   server: {summary.get('url')}   config {summary.get('config_digest')}",
        f"spec: {summary.get('algorithm')} steps={summary.get('num_steps')} topk={summary.get('topk')} "
        f"draft_tokens={summary.get('num_draft_tokens')} tp={summary.get('tp_size')}",
        f"requests: {summary.get('n_requests')} ({summary.get('n_missing_spec')} without spec fields, "
        f"{summary.get('n_failed')} failed), concurrency {summary.get('concurrency')}, "
        f"max_new_tokens {summary.get('max_new_tokens')}",
        f"accept length (Σcompletion/Σverify, {lvl}% CI): {f('accept_length')}",
        f"accept length, mean of per-request ratios:   {f('accept_length_mean_of_ratios')}",
        f"accept length, 1 + accepted/steps (hist):     {f('accept_length_hist')}",
        f"accept rate (correct/proposed drafts):        {f('accept_rate')}",
        f"tok/s per request stream:                     {f('tok_s', 1)}   (batch throughput "
        f"{summary.get('throughput_tok_s', float('nan')):.1f} tok/s)",
        f"latency mean (s):                             {f('latency_mean_s')}",
    ]
    if summary.get("baseline_tok_s") is not None and math.isfinite(summary.get("baseline_tok_s", float("nan"))):
        lines.append(f"baseline tok/s: {f('baseline_tok_s', 1)}   speedup x{summary.get('speedup', float('nan')):.2f}")
    return "\n".join(lines)
