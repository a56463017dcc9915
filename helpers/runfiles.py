"""Run folders and atomic file writes (nothing already written is ever overwritten or half-written).

A run folder is ``<parent>/<YYYYmmdd-HHMMSS>-<name>``; when that exists (two runs in the same
second) ``-2``, ``-3``, ... is appended. Files are written to a temporary file in the same folder
and renamed into place, so a reader sees the old file or the new one, never a partial one.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import io
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from pydantic import BaseModel, ValidationError

from .errors import BadInput
from .paths import outputs_dir

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

DEFAULT_OUTPUTS = Path(__file__).resolve().parents[1] / "outputs"

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def safe_name(name: str, limit: int = 60) -> str:
    """``name`` reduced to letters, digits, ``.``, ``_`` and ``-`` (for folder and file names)."""
    return (_SAFE.sub("-", str(name)).strip("-.") or "run")[:limit]


def new_run_dir(name: str, outputs: str | os.PathLike | None = None,
                stamp: Optional[str] = None) -> Path:
    """Create and return a fresh ``<outputs>/<YYYYmmdd-HHMMSS>-<name>`` folder (default
    ``outputs/`` of the repository, or ``$E3F_OUTPUTS``). Never reuses a folder: on collision ``-2``, ``-3``, ... are
    tried (``mkdir`` is atomic, so two processes starting in the same second differ)."""
    outputs = Path(outputs) if outputs is not None else outputs_dir()
    outputs.mkdir(parents=True, exist_ok=True)
    base = f"{stamp or datetime.now().strftime('%Y%m%d-%H%M%S')}-{safe_name(name)}"
    for i in range(1, 10000):
        path = outputs / (base if i == 1 else f"{base}-{i}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise RuntimeError(f"could not create a new run folder under {outputs}")


def mark_failed(run_dir: str | os.PathLike, reason: str) -> Optional[Path]:
    """After a failed run: remove ``run_dir`` when it holds no file at all (a folder created for nothing), else write
    ``run_dir/FAILED`` with the one-line reason so a half-written run folder is never mistaken for a result.
    Returns the marker path, or None when the folder was removed or cannot be written (a full disk)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    if not any(p.is_file() for p in run_dir.rglob("*")):
        shutil.rmtree(run_dir, ignore_errors=True)
        return None
    try:
        return atomic_write_text(run_dir / "FAILED", reason.strip() + "\n")
    except OSError:
        return None


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@functools.lru_cache(maxsize=1)
def _umask() -> int:
    """The process umask, read without changing it (``/proc/self/status``; 0o022 where that is not available)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temp file in the same folder, fsync and rename;
    create parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())        # mkstemp makes 0600; a run's files are meant to be shared
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """UTF-8 text version of :func:`atomic_write_bytes`."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_new(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` under a name that does not exist yet and return it: ``path`` itself, else ``<stem>-2<suffix>``,
    ``-3``, ... (an existing file is never overwritten; two writers at once get one name each: the temp file is
    hard-linked into place, which fails when the name exists).

    Raises: OSError when the folder cannot be written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        for i in range(1, 10000):
            dest = path if i == 1 else path.with_name(f"{path.stem}-{i}{path.suffix}")
            try:
                os.link(tmp, dest)
            except FileExistsError:
                continue
            _fsync_dir(path.parent)
            return dest
        raise FileExistsError(f"{path}: no free name up to -9999")
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def jsonable(x: Any, *, sig: Optional[int] = None, keep_inf: bool = False) -> Any:
    """``x`` as plain JSON values: mappings (keys as ``str``), lists / tuples / sets, numpy scalars, pydantic models
    (``model_dump(mode="json")``), ``Path`` (``str``), arrays and tensors (``tolist()``); NaN -> ``None``, +-inf ->
    ``None`` unless ``keep_inf``; floats rounded to ``sig`` significant digits when given. Objects with a
    ``to_json()`` method (e.g. :class:`helpers.diagnosis.compare.PairMetrics`) are converted by it. Anything else is
    returned as is. The one converter for findings' evidence, check results and notebook results."""
    if isinstance(x, BaseModel):
        return jsonable(x.model_dump(mode="json"), sig=sig, keep_inf=keep_inf)
    if isinstance(x, Mapping):
        return {str(k): jsonable(v, sig=sig, keep_inf=keep_inf) for k, v in x.items()}
    if isinstance(x, (list, tuple, set)):
        return [jsonable(v, sig=sig, keep_inf=keep_inf) for v in x]
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, (np.floating, float)):
        v = float(x)
        if math.isnan(v) or (math.isinf(v) and not keep_inf):
            return None
        return float(f"{v:.{sig}g}") if sig and math.isfinite(v) else v
    if isinstance(x, Path):
        return str(x)
    if callable(getattr(x, "to_json", None)) and _no_required_args(x.to_json):
        return jsonable(x.to_json(), sig=sig, keep_inf=keep_inf)
    if callable(getattr(x, "tolist", None)):          # numpy arrays, torch tensors
        return jsonable(x.tolist(), sig=sig, keep_inf=keep_inf)
    return x


def _no_required_args(fn: Any) -> bool:
    try:
        return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                   for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Atomically write ``obj`` as indented JSON (non-JSON values via ``str``)."""
    return atomic_write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def read_json_file(path: str | os.PathLike, what: str, *, error: type = BadInput, expected: str = "a JSON object") -> Any:
    """The parsed JSON of a file the user named (a config, a manifest, a saved server answer).

    Raises ``error`` (a :class:`helpers.errors.BadInput` subclass, default BadInput) with the path and ``what`` in
    one line when the file is missing, unreadable, empty (``expected`` says what it should hold) or not valid JSON
    (message, line and column). The one reader of user-named JSON files."""
    p = Path(path)
    if not p.exists():
        raise error(f"{what} not found", path=p)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"cannot read {what}: {getattr(e, 'strerror', None) or e}", path=p) from None
    if not text.strip():
        raise error(f"{what} is an empty file (expected {expected})", path=p)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{what} is not valid JSON, or truncated ({e.msg} at line {e.lineno} column {e.colno})",
                    path=p) from None
    except RecursionError:
        raise error(f"{what} nests arrays/objects too deeply to parse (expected {expected})", path=p) from None


def read_json(path: str | os.PathLike, default: Any = None) -> Any:
    """JSON content of ``path``, or ``default`` when the file does not exist."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return default


def parquet_bytes(df: pd.DataFrame) -> bytes:
    """``df`` (index dropped) as Parquet file bytes, written without Arrow's thread pools.

    Why not ``df.to_parquet``: pandas/pyarrow convert and read with Arrow's global CPU and I/O
    thread pools; a CLI that exits right after (``python -m helpers measure``) then races those
    pools' teardown and sometimes aborts *after* its work is done with ``terminate called without
    an active exception`` (exit -6): 19 of 600 short ledger-writing processes on 2 cores (4 at
    once) with pandas' defaults, 0 of 600 with these functions (``bench/bench_parquet_exit.py``,
    bench/RESULTS.md). Known upstream: apache/arrow#34314, #39862. Converting with ``nthreads=1`` and writing with
    ``pyarrow.parquet.write_table`` starts no thread. Pair with :func:`read_parquet`.

    Returns: bytes (pass to :func:`atomic_write_bytes`).
    """


    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False, nthreads=1), buf)
    return buf.getvalue()


def read_parquet(source: str | os.PathLike | bytes) -> pd.DataFrame:
    """Read a Parquet file (path or bytes) into a DataFrame without starting Arrow's thread pools.

    Same frame as ``pandas.read_parquet`` (with pandas >= 3, Arrow strings become pandas' ``str``
    dtype, as there), but read with ``pre_buffer=False`` and ``use_threads=False``:
    ``pyarrow.parquet.read_table`` starts an I/O thread even with ``use_threads=False``; see
    :func:`parquet_bytes` for why threads matter at exit.

    Raises: ``FileNotFoundError``; ``pyarrow.ArrowInvalid`` for a file that is not Parquet.
    """


    src = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else os.fspath(source)
    table = pq.ParquetFile(src, pre_buffer=False).read(use_threads=False)
    kwargs: dict = {"use_threads": False}
    if int(pd.__version__.split(".")[0]) >= 3:
        # pandas >= 3 maps Arrow strings to its "str" dtype, as pandas.read_parquet does

        str_dtype = pd.StringDtype(na_value=float("nan"))
        kwargs["types_mapper"] = {pa.string(): str_dtype, pa.large_string(): str_dtype}.get
    return table.to_pandas(**kwargs)


def load_yaml_model(source: Any, model: Any, *, what: str, error: type = None, prepare: Any = None) -> Any:
    """Read a YAML file (or take already-parsed data) and validate it with a pydantic ``model``: the one loader of
    the suite's YAML files (case files, fixes files, suite params).

    Args:
        source: a path, or parsed data (dict / list).
        model: the pydantic model class.
        what: what the file is, for messages (``"case file"``, ``"fixes file"``, ``"params file"``).
        error: the :class:`helpers.errors.BadInput` subclass to raise (default BadInput).
        prepare: optional ``fn(data) -> data`` applied before validation (e.g. a bare list -> ``{"fixes": list}``).

    Returns:
        The validated model instance.

    Raises:
        ``error``: missing or unreadable file, invalid YAML, not a mapping, or an invalid field; one line naming
            the file and the field (``timeline.2.hypothesis.check``) and what was expected.
    """


    error = error or BadInput
    path = None
    data = source
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir():
            raise error(f"{what} expected, got a folder", path=path)
        try:
            data = yaml.safe_load(path.read_text())
        except FileNotFoundError:
            raise error(f"{what} does not exist", path=path) from None
        except OSError as exc:
            raise error(f"{what} cannot be read ({exc.strerror or exc})", path=path) from None
        except yaml.YAMLError as exc:
            raise error(f"{what} is not valid YAML ({' '.join(str(exc).split())})", path=path) from None
    if prepare is not None:
        data = prepare(data)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise error(f"{what} must be a mapping of fields, got {type(data).__name__}", path=path)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
        raise error(f"{first['msg']}{more}", path=path if path is not None else what, field=where) from None
