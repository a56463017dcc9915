"""Run folders, the append-only fixes ledger, and managed mode (a server per fix).

Run folders (DESIGN.md "Run folders"): ``outputs/<YYYYmmdd-HHMMSS>-<name>/``, created fresh per
run (``-2``, ``-3``, ... on collision, by an atomic ``mkdir``); files are written to a temp file in
the same folder and renamed into place (:func:`atomic_write_bytes`), so a reader never sees half a
file and nothing already written is lost.

Ledger: ``<run>/ledger.parquet``, one row per measured fix: ``fix``, ``config_digest`` (hash of the
effective server config, no secrets: :func:`helpers.acceptance.measure.config_digest`), ``timestamp``, every
summary figure with its CI, per-position rates and histogram as JSON. :meth:`Ledger.append` takes
an exclusive ``fcntl.flock`` on ``ledger.parquet.lock``, reads the current rows, writes old + new
rows to a temp file, checks every old ``row_id`` survived, and renames it over the old file. Two
processes appending at once therefore serialise and lose nothing; rows are never edited or dropped.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import uuid
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import pandas as pd

from ..runfiles import (  # noqa: F401
    DEFAULT_OUTPUTS,
    atomic_write_bytes,
    atomic_write_text,
    new_run_dir,
    parquet_bytes,
    read_parquet,
    safe_name,
)
from ..redaction import redact


class LedgerError(RuntimeError):
    """The ledger file cannot be read (it is left untouched) or an append would lose rows."""


class Ledger:
    """Append-only parquet table of fixes (see module docstring).

    ``path``: the ``ledger.parquet`` file (its folder is created). Each appended row gets
    ``row_id`` (uuid4 hex), ``appended_at`` (UTC ISO-8601) and ``writer_pid``.
    """

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")

    def __repr__(self) -> str:
        return f"<Ledger {self.path}>"

    @contextlib.contextmanager
    def _lock(self, exclusive: bool = True) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o666)     # the umask decides, as for every file
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _read_unlocked(self) -> pd.DataFrame:
        if not self.path.exists():
            return pd.DataFrame()
        try:
            # one open() = one consistent file (a concurrent os.replace cannot mix two versions)
            return read_parquet(self.path.read_bytes())
        except FileNotFoundError:
            return pd.DataFrame()
        except Exception as exc:  # noqa: BLE001 - any parquet/arrow error
            raise LedgerError(f"ledger {self.path} is unreadable ({type(exc).__name__}: {exc}); "
                              "it was left as is: move it away to start a new one") from None

    def read(self) -> pd.DataFrame:
        """All rows (empty DataFrame when the ledger does not exist yet)."""
        with self._lock(exclusive=False):
            return self._read_unlocked()

    def __len__(self) -> int:
        return len(self.read())

    def append(self, rows: Mapping[str, Any] | Sequence[Mapping[str, Any]] | pd.DataFrame) -> pd.DataFrame:
        """Append one or more rows under the file lock; returns the appended rows (with ids).

        Values that are lists/dicts are stored as JSON strings; secrets are never expected here
        (rows come from :meth:`helpers.acceptance.measure.AcceptanceResult.ledger_row`), but string
        cells are passed through :func:`helpers.redaction.redact` anyway.
        """
        if isinstance(rows, pd.DataFrame):
            recs = rows.to_dict(orient="records")
        elif isinstance(rows, Mapping):
            recs = [dict(rows)]
        else:
            recs = [dict(r) for r in rows]
        if not recs:
            raise ValueError("nothing to append")
        now = pd.Timestamp.now(tz="UTC").isoformat()
        clean = []
        for r in recs:
            r = redact(r)
            r = {k: (json.dumps(v, default=str) if isinstance(v, (list, dict, tuple)) else v)
                 for k, v in r.items()}
            r.setdefault("row_id", uuid.uuid4().hex)
            r.setdefault("appended_at", now)
            r.setdefault("writer_pid", os.getpid())
            clean.append(r)
        new = pd.DataFrame(clean)
        with self._lock(exclusive=True):
            old = self._read_unlocked()
            merged = pd.concat([old, new], ignore_index=True) if len(old) else new
            merged = _arrow_safe(merged)
            data = parquet_bytes(merged)
            check = read_parquet(data)
            if len(old) and "row_id" in old.columns and \
                    not set(old["row_id"].dropna()).issubset(set(check["row_id"])):
                raise LedgerError("refusing to write: the new ledger would lose rows")
            if len(check) != len(old) + len(new):
                raise LedgerError(f"refusing to write: expected {len(old) + len(new)} rows, got {len(check)}")
            atomic_write_bytes(self.path, data)
        return new


def _arrow_safe(df: pd.DataFrame) -> pd.DataFrame:
    """Make object columns writable by pyarrow: mixed non-null types become strings."""
    df = df.copy()
    for c in df.columns:
        if df[c].dtype != object:
            continue
        kinds = {type(v) for v in df[c] if v is not None and not (isinstance(v, float) and v != v)}
        if len(kinds) > 1:
            df[c] = df[c].map(lambda v: v if v is None or (isinstance(v, float) and v != v) else str(v))
    return df
