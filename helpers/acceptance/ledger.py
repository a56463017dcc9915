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

A ledger that cannot be read (truncated by a full disk, edited by hand), or a Parquet file of another table in its
place (:func:`ledger_shape_problem`: without the columns :data:`LEDGER_COLUMNS` every ledger row has, or with them not
text, a column of a type the tool never writes, or no column at all), is :class:`LedgerUnreadable` (bad input,
exit 2) and is never written over; every row it indexed is also in the measurement folders it points to
(``saved_to``), from which :meth:`Ledger.rebuild` writes a new one (``python -m helpers measure --rebuild-ledger
RUN_DIR``: :func:`helpers.acceptance.measure.rebuild_ledger`), keeping the old file beside it.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import json
import os
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ..runfiles import (  # noqa: F401
    DEFAULT_OUTPUTS,
    atomic_write_bytes,
    atomic_write_text,
    new_run_dir,
    parquet_bytes,
    read_parquet,
    safe_name,
)
from ..errors import BadInput, RunFailed
from ..redaction import redact

#: what the command that rebuilds a run folder's ledger from its measurement folders is (one place for the hint)
REBUILD_COMMAND = "python -m helpers measure --rebuild-ledger {run_dir}"


#: the columns every row of a ledger has had since the first ledger (the fix's name; the id :func:`_flat` gives each
#: row): a Parquet file without them is another table, not a ledger (issue 40)
LEDGER_COLUMNS = ("fix", "row_id")


def ledger_shape_problem(schema: pa.Schema, rows: int) -> Optional[str]:
    """Why a readable Parquet table is not a ledger this tool wrote (issue 40), or None when it is one. Every ledger
    this tool has written (:meth:`Ledger.append` / :meth:`Ledger.rebuild` through
    :func:`helpers.runfiles.parquet_bytes`, from the rows of :meth:`helpers.acceptance.measure.AcceptanceResult.record`)
    is a table whose

    * columns include :data:`LEDGER_COLUMNS` (``fix``, ``row_id``), both strings (a fix's name; a uuid4 hex);
    * columns are all flat: text, numbers, booleans or empty (lists and dicts are stored as JSON text, ``*_json``) --
      a list, map, struct, binary or dictionary column is one it never writes;
    * a table of no column is one only when it has no row and pandas' schema record (what ``parquet_bytes`` writes:
      a rebuild from no measurement folder); ``pyarrow.parquet.write_table(pa.table({}))`` is not.

    Column *names* are not checked: the summary's figures have grown release by release, so an older ledger's
    columns are not a fixed list.

    Returns: one clause naming the columns at fault, or None."""
    names = list(schema.names)
    if not names:
        if rows == 0 and b"pandas" in (schema.metadata or {}):
            return None
        return (f"a table of no column ({rows} row{'s' if rows != 1 else ''}, not written by this tool); a ledger's "
                f"rows all have {', '.join(LEDGER_COLUMNS)}")
    missing = [c for c in LEDGER_COLUMNS if c not in names]
    if missing:
        shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
        return (f"its columns are {shown}; a ledger's rows all have {', '.join(LEDGER_COLUMNS)}, it lacks "
                f"{', '.join(missing)}")
    for c in LEDGER_COLUMNS:
        t = schema.field(c).type
        if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
            return f"its column {c} holds {_type_word(t)}, not text (a ledger's {c} is a string in every row)"
    flat = (pa.types.is_string, pa.types.is_large_string, pa.types.is_integer, pa.types.is_floating,
            pa.types.is_boolean, pa.types.is_null)
    for f in schema:
        if not any(test(f.type) for test in flat):
            return (f"its column {f.name} holds {_type_word(f.type)}, a type this tool never writes (a ledger's columns are text, "
                    "numbers, booleans; lists and dicts as JSON text)")
    return None


def _type_word(t: pa.DataType) -> str:
    """An Arrow type in a word for messages (``integers``, ``lists``, ``maps``, ...)."""
    for test, word in ((pa.types.is_integer, "integers"), (pa.types.is_floating, "floats"),
                       (pa.types.is_boolean, "booleans"), (pa.types.is_map, "maps"),
                       (lambda x: pa.types.is_list(x) or pa.types.is_large_list(x) or pa.types.is_fixed_size_list(x),
                        "lists"), (pa.types.is_struct, "structs"), (pa.types.is_dictionary, "dictionary-encoded values"),
                       (lambda x: pa.types.is_binary(x) or pa.types.is_large_binary(x) or
                        pa.types.is_fixed_size_binary(x), "bytes"), (pa.types.is_temporal, "dates / times")):
        if test(t):
            return word
    return str(t)


class LedgerError(RunFailed):
    """An append that would lose rows (the ledger is left as it was); exit 1."""


class LedgerUnreadable(BadInput):
    """The ledger file (or its lock file) cannot be read: bad input naming the file, what was expected, and the
    command that rebuilds it from the measurement folders (:data:`REBUILD_COMMAND`); the file is left as is. Exit 2.

    Args:
        path: the ``ledger.parquet`` (or its lock file).
        reason: what went wrong reading it (one clause).
        kept: a measurement folder kept although its row could not be appended (relative to the run folder), if any.
    """

    def __init__(self, path: Path | str, reason: str, *, kept: str | None = None):
        self.reason = reason
        self.kept = kept
        run_dir = Path(path).parent
        what = "" if kept is None else f" and the new measurement was kept in {kept}"
        super().__init__(f"the ledger cannot be read ({reason}); expected the Parquet table of measurements this "
                         f"tool writes. It was left as is{what}: rebuild the ledger from the measurement folders "
                         f"with `{REBUILD_COMMAND.format(run_dir=run_dir)}`", path=path)


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
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o666)     # the umask decides, as for every file
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):                   # our own write failed: a full disk
                raise OSError(exc.errno, exc.strerror, str(self.lock_path)) from None
            raise LedgerUnreadable(self.lock_path, f"its lock file cannot be opened: {exc.strerror or exc}") from None
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
            data = self.path.read_bytes()
            df = read_parquet(data)
            schema = pq.ParquetFile(io.BytesIO(data)).schema_arrow
        except FileNotFoundError:
            return pd.DataFrame()
        except OSError as exc:
            raise LedgerUnreadable(self.path, exc.strerror or str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - any parquet/arrow error
            raise LedgerUnreadable(self.path, f"not a Parquet file, or truncated: {exc}") from None
        why = ledger_shape_problem(schema, len(df))
        if why is not None:
            raise LedgerUnreadable(self.path, f"a Parquet table of another shape: {why}")
        return df

    def read(self) -> pd.DataFrame:
        """All rows (empty DataFrame when the ledger does not exist yet).

        Raises:
            LedgerUnreadable: the file (or its lock file) cannot be read, or is a Parquet table that is not a
                ledger (:func:`ledger_shape_problem`: no column, the key columns missing or not text, a column of a
                type this tool never writes); it is left as is."""
        with self._lock(exclusive=False):
            return self._read_unlocked()

    def __len__(self) -> int:
        return len(self.read())

    def append(self, rows: Mapping[str, Any] | Sequence[Mapping[str, Any]] | pd.DataFrame) -> pd.DataFrame:
        """Append one or more rows under the file lock; returns the appended rows (with ids).

        Values that are lists/dicts are stored as JSON strings; secrets are never expected here
        (rows come from :meth:`helpers.acceptance.measure.AcceptanceResult.ledger_row`), but string
        cells are passed through :func:`helpers.redaction.redact` anyway.

        Raises:
            LedgerUnreadable: the current ledger (or its lock file) cannot be read: nothing is written.
            LedgerError: the new file would lose a row (nothing is written).
            OSError: the new file cannot be written (a full disk: naming ``ledger.parquet``); the old one stays.
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
        new = pd.DataFrame(_flat(recs, now))
        with self._lock(exclusive=True):
            old = self._read_unlocked()
            try:
                merged = pd.concat([old, new], ignore_index=True) if len(old) else new
                merged = _arrow_safe(merged)
                data = parquet_bytes(merged)
                check = read_parquet(data)
                if len(old) and "row_id" in old.columns and \
                        not set(old["row_id"].dropna()).issubset(set(check["row_id"])):
                    raise LedgerError("the new ledger would lose rows")
                if len(check) != len(old) + len(new):
                    raise LedgerError(f"expected {len(old) + len(new)} rows, got {len(check)}")
            except (LedgerError, ValueError, TypeError, KeyError, pa.ArrowException) as exc:
                if not len(old):
                    raise
                # the old ledger's rows are readable but not the table this tool writes (a column of another type,
                # one it never writes): that file's state, not this append's -- bad input naming it; the caller
                # keeps the measurement (AcceptanceResult.record), the ledger is left as it was
                raise LedgerUnreadable(self.path, f"its rows cannot take a new one without loss ({exc}); refusing "
                                                  "to write") from None
            atomic_write_bytes(self.path, data)
        return new

    def rebuild(self, rows: Sequence[Mapping[str, Any]]) -> Optional[Path]:
        """Replace the ledger with ``rows`` (those of the run folder's measurement folders, in order), under the file
        lock; the file it replaces -- unreadable or not -- is kept beside it first, never written over:
        ``ledger.parquet.corrupt-<YYYYmmdd-HHMMSS>`` when it could not be read, ``ledger.parquet.before-rebuild-<...>``
        when it could (``-2``, ... when taken; a hard link, so ``ledger.parquet`` is never missing). The new file is
        written atomically. Rows are flattened as by :meth:`append`.

        Returns: the path the old ledger was kept at, or None when there was none.

        Raises:
            LedgerError: the written file does not read back with every row.
            OSError: a file cannot be written (naming it).
        """
        now = pd.Timestamp.now(tz="UTC").isoformat()
        new = _arrow_safe(pd.DataFrame(_flat([dict(r) for r in rows], now)))
        data = parquet_bytes(new)
        if len(read_parquet(data)) != len(new):
            raise LedgerError(f"refusing to write: expected {len(new)} rows, got {len(read_parquet(data))}")
        with self._lock(exclusive=True):
            kept = None
            if self.path.exists():
                try:
                    self._read_unlocked()
                    tag = "before-rebuild"
                except LedgerUnreadable:
                    tag = "corrupt"
                stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
                for i in range(1, 10000):
                    kept = self.path.with_name(f"{self.path.name}.{tag}-{stamp}" + ("" if i == 1 else f"-{i}"))
                    try:
                        os.link(self.path, kept)        # never over an existing name; the ledger stays in place
                        break
                    except FileExistsError:
                        continue
                    except OSError as exc:
                        raise OSError(exc.errno, exc.strerror, str(kept)) from None
            atomic_write_bytes(self.path, data)
        return kept


def _flat(recs: Sequence[dict], now: str) -> list[dict]:
    """Rows as the ledger stores them: redacted, lists / dicts as JSON strings, ``row_id`` / ``appended_at`` /
    ``writer_pid`` filled where missing."""
    clean = []
    for r in recs:
        r = redact(r)
        r = {k: (json.dumps(v, default=str) if isinstance(v, (list, dict, tuple)) else v) for k, v in r.items()}
        r.setdefault("row_id", uuid.uuid4().hex)
        r.setdefault("appended_at", now)
        r.setdefault("writer_pid", os.getpid())
        clean.append(r)
    return clean


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
