"""Run folders and atomic file writes (nothing already written is ever overwritten or half-written).

A run folder is ``<parent>/<YYYYmmdd-HHMMSS>-<name>``; when that exists (two runs in the same
second) ``-2``, ``-3``, ... is appended. Files are written to a temporary file in the same folder
and renamed into place, so a reader sees the old file or the new one, never a partial one.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import inspect
import io
import json
import math
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from pydantic import BaseModel, ValidationError

from .errors import BadInput
from .paths import outputs_dir, shared_mode
from .redaction import scrub

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
    ``run_dir/FAILED`` with the one-line reason so a half-written run folder is never mistaken for a result (on a
    full disk an empty ``FAILED``, when not even the reason fits). Returns the marker path, or None when the folder
    was removed or nothing can be created in it."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    if not any(p.is_file() for p in run_dir.rglob("*")):
        shutil.rmtree(run_dir, ignore_errors=True)
        return None
    marker = run_dir / "FAILED"
    try:
        return atomic_write_text(marker, reason.strip() + "\n")
    except OSError:
        pass
    try:        # a full disk: a file with no data still fits (an inode, no block); the reason is then on stderr only
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    except OSError:
        return None
    with contextlib.suppress(OSError):
        os.write(fd, (reason.strip() + "\n").encode("utf-8", "backslashreplace"))
    os.close(fd)
    return marker


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temp file in the same folder, fsync and rename;
    create parent folders. The file gets the umask's mode (:func:`helpers.paths.shared_mode`).

    Raises:
        OSError: naming ``path`` itself (``str(exc)`` ends with it; ``exc.filename``), whatever failed: a full disk
            (ENOSPC) while writing the temp file, a read-only folder, ...; no temp file is left.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise _naming(exc, path) from None
    try:
        os.fchmod(fd, shared_mode())        # mkstemp makes 0600; a run's files are meant to be shared
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise _naming(exc, path) from None
        raise
    _fsync_dir(path.parent)
    return path


def _naming(exc: OSError, path: Path) -> OSError:
    """``exc`` naming ``path`` (a write error on an open file names none; a temp file's name means nothing to the
    reader)."""
    if exc.errno is None:
        return exc
    return OSError(exc.errno, exc.strerror or os.strerror(exc.errno), str(path))


@contextlib.contextmanager
def staged_folder(folder: str | os.PathLike) -> Iterator[Path]:
    """A new temporary folder next to ``folder`` (``.<name>.<random>.tmp``, the umask's mode) to write a folder's
    files into before the caller renames it into place (measurements, dumps): a reader never sees half a folder.
    On any error inside the block the temporary folder is removed, and an OSError naming a path inside it is raised
    again naming the same path under ``folder`` -- the file the user asked for, never the staging name (a full disk
    is ``<run>/fixes/x/summary.json: no space left on the device``).

    Yields: the temporary folder (empty). Raises: OSError naming ``folder`` or a file under it."""
    folder = Path(folder)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    except OSError as exc:
        raise _naming(exc, folder) from None
    try:
        os.chmod(tmp, shared_mode(folder=True))     # mkdtemp makes 0700; a run folder is meant to be shared
        yield tmp
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and exc.filename is not None and exc.errno is not None:
            try:
                rel = Path(os.fsdecode(exc.filename)).relative_to(tmp)
            except ValueError:
                raise exc from None
            raise OSError(exc.errno, exc.strerror or os.strerror(exc.errno), str(folder / rel)) from None
        raise


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, Any], metadata: Optional[dict] = None) -> Path:
    """``safetensors.torch.save_file`` (it writes atomically itself) with the run folder's rules: the file gets the
    umask's mode (safetensors creates 0600), and a failed write is an OSError naming ``path`` (safetensors raises
    ``SafetensorError ... (os error 28)`` for a full disk).

    Args:
        path: the ``.safetensors`` file to write.
        tensors: ``{name: contiguous CPU torch.Tensor}``.
        metadata: string-to-string header metadata.

    Raises:
        OSError: the file could not be written (``<path>: No space left on device`` ...).
    """
    # lazy: safetensors.torch imports torch, and the torch-free commands import this module
    from safetensors import SafetensorError
    from safetensors.torch import save_file  # lazy: as above

    path = Path(path)
    try:
        save_file(dict(tensors), os.fspath(path), metadata=metadata)
    except SafetensorError as exc:
        code = re.search(r"os error (\d+)", str(exc))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None
    os.chmod(path, shared_mode())
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """UTF-8 text version of :func:`atomic_write_bytes`; every secret the process has met (the API key, a launch
    command's ``--api-key`` values, values of a server answer's secret fields: :func:`helpers.redaction.scrub`)
    is replaced by ``<redacted>`` first, whatever path the text took."""
    return atomic_write_bytes(path, scrub(text).encode("utf-8"))


def atomic_write_new(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` under a name that does not exist yet and return it: ``path`` itself, else ``<stem>-2<suffix>``,
    ``-3``, ... (an existing file is never overwritten; two writers at once get one name each: the temp file is
    hard-linked into place, which fails when the name exists).

    Raises: OSError when the folder cannot be written, naming ``path`` (never the temporary file)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise _naming(exc, path) from None
    try:
        os.fchmod(fd, shared_mode())
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
        raise FileExistsError(errno.EEXIST, "no free name up to -9999", str(path))
    except OSError as exc:
        if isinstance(exc, FileExistsError):
            raise
        raise _naming(exc, path) from None
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


#: Token ids read from any file (training data, prompt files) are below this: SGLang keeps them in int32 tensors, and
#: no vocabulary comes near.
MAX_TOKEN_ID = 2 ** 31

#: Deepest JSON nesting read from a file or a server answer (arrays / objects inside each other). SGLang's answers
#: nest about 5 deep (``meta_info.hidden_states[0][t][d]``), configs and manifests less than 10; deeper than this is
#: refused before anything walks it (redaction, pydantic and the writers recurse once per level).
MAX_JSON_DEPTH = 100


class JSONTooDeep(ValueError):
    """JSON nested deeper than :data:`MAX_JSON_DEPTH` (or than Python's parser can follow)."""


class JSONNumberTooLong(JSONTooDeep):
    """An integer literal longer than Python converts (``sys.get_int_max_str_digits()``, 4300 digits by default).
    A :class:`JSONTooDeep` so every handler of the parser's limits takes it too."""


#: Largest file (bytes) the readers of user-named files take by default (:func:`read_file_bytes`): a config, a
#: manifest, a params / case / fixes file or a prompt file is far smaller (a 1T-parameter model's safetensors index
#: is ~10 MiB); a saved ``/generate`` answer is read up to the client's own ``/generate`` limit instead.
MAX_FILE_BYTES = 64 * 2 ** 20

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))


def file_kind(mode: int) -> str:
    """What a ``st_mode`` is, in words (``"a FIFO (named pipe)"``, ``"a character device"``, ...)."""
    return next((w for test, w in _KINDS if test(mode)), "not a regular file")


def regular_file(path: str | os.PathLike, what: str, *, max_bytes: Optional[int] = None,
                 error: type = BadInput) -> Path:
    """``path`` when it is a regular file (symlinks followed) of at most ``max_bytes`` bytes (None: any size): the
    check before a reader opens a user-named file it cannot read without blocking or without bound (safetensors,
    ``torch.load``), so a FIFO, ``/dev/zero``, a socket or a symlink loop is refused at once.

    Raises:
        ``error`` (default BadInput) naming the file and ``what``: missing, a symlink loop or unreadable metadata,
        not a regular file (saying what it is), or larger than ``max_bytes`` (both sizes named)."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise error(f"{what} not found", path=p) from None
    except OSError as e:
        raise error(f"cannot read {what}: {e.strerror or e}", path=p) from None
    _check_stat(st, p, what, max_bytes, error)
    return p


def _check_stat(st: os.stat_result, p: Path, what: str, max_bytes: Optional[int], error: type) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what} is {file_kind(st.st_mode)}, not a regular file (expected a file to read)", path=p)
    if max_bytes is not None and st.st_size > max_bytes:
        raise error(f"{what} is {st.st_size / 2**20:.1f} MiB, over the limit of {max_bytes / 2**20:.0f} MiB for "
                    "this file (is it the right file?)", path=p)


def read_file_bytes(path: str | os.PathLike, what: str, *, max_bytes: int = MAX_FILE_BYTES,
                    error: type = BadInput) -> bytes:
    """The bytes of a user-named file, read only when it is a regular file of at most ``max_bytes`` bytes
    (:data:`MAX_FILE_BYTES` by default): opened without blocking (a FIFO never hangs the reader) and checked on the
    opened descriptor, then read at most ``max_bytes + 1`` bytes (a file growing meanwhile is refused too).

    Raises:
        ``error`` (default BadInput) naming the file and ``what``: missing, unreadable (a symlink loop, no
        permission), not a regular file (a FIFO, a device such as ``/dev/zero``, a socket, a folder), over the limit.
    """
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"{what} not found", path=p) from None
    except OSError as e:
        with contextlib.suppress(OSError):      # a socket cannot be opened (ENXIO): say what it is
            _check_stat(os.stat(p), p, what, None, error)
        raise error(f"cannot read {what}: {e.strerror or e}", path=p) from None
    try:
        _check_stat(os.fstat(fd), p, what, max_bytes, error)
        with os.fdopen(fd, "rb", closefd=True) as f:
            fd = -1
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"cannot read {what}: {e.strerror or e}", path=p) from None
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > max_bytes:
        raise error(f"{what} grew over the limit of {max_bytes / 2**20:.0f} MiB while being read", path=p)
    return data


@contextlib.contextmanager
def armed_file(path: str | os.PathLike, note: str, *, what: str = "arm file") -> Iterator[Path]:
    """Create ``path`` (a server hook's arm file, e.g. ``<trace folder>/ARMED``, :data:`helpers.hooks.ARM_FILE`)
    for the duration of the block, and remove it after, only if it is still the file this call created.

    Created with ``O_CREAT | O_EXCL | O_WRONLY | O_NOFOLLOW``: a path that already exists -- another trace armed on
    the same server (two checks at once would read each other's records and the first to finish would disarm the
    other), a file the user keeps there, or a symlink planted to make the tool write elsewhere -- is refused, never
    written through and never deleted. On exit the path is unlinked only when its ``lstat`` still shows the device
    and inode this call created, its descriptor held open meanwhile so that the inode is not reused (a file
    replaced meanwhile is left alone).

    Raises:
        BadInput: one line naming the path: it exists (saying what it is: a file, a symlink, ...) or cannot be
            created (the folder missing or not writable)."""
    p = Path(path)
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(p, flags, 0o644)
    except FileExistsError:
        try:
            mode = os.lstat(p).st_mode
            kind = "a symlink" if stat.S_ISLNK(mode) else "a file" if stat.S_ISREG(mode) else file_kind(mode)
        except OSError:
            kind = "a file"
        raise BadInput(f"the {what} exists ({kind}): another trace or capture is armed on this server now, or "
                       "the file is not this tool's; it is never overwritten nor deleted: wait for the other run, "
                       "or remove it yourself if none runs", path=p) from None
    except OSError as e:
        raise BadInput(f"cannot create the {what}: {e.strerror or e}", path=p) from None
    try:             # the descriptor stays open to the end: the inode cannot be freed and reused by a newcomer
        st = os.fstat(fd)
        os.write(fd, note.encode("utf-8", "replace"))
        yield p
    finally:
        with contextlib.suppress(OSError):
            now = os.lstat(p)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(p)
        os.close(fd)


def read_file_text(path: str | os.PathLike, what: str, *, max_bytes: int = MAX_FILE_BYTES, error: type = BadInput,
                   expected: str = "text") -> str:
    """:func:`read_file_bytes` decoded as UTF-8.

    Raises:
        ``error``: as :func:`read_file_bytes`, or not UTF-8 (the byte offset named, ``expected`` said)."""
    data = read_file_bytes(path, what, max_bytes=max_bytes, error=error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} is not a UTF-8 text file (byte {e.start}: {e.reason}); expected {expected}",
                    path=path) from None


def loads_json(data: str | bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` with the nesting bounded: the one JSON parser of files and server answers.

    Raises:
        json.JSONDecodeError: not JSON.
        JSONTooDeep: arrays / objects nested deeper than ``max_depth``; checked without recursion after parsing
            (a 200000-deep document stops the parser itself, which raises RecursionError: turned into this too).
    """
    try:
        obj = json.loads(data)
    except RecursionError:
        raise JSONTooDeep(f"nests arrays/objects too deeply (more than {max_depth} levels)") from None
    except json.JSONDecodeError:
        raise
    except ValueError as e:     # int('9' * 5000): "Exceeds the limit (4300 digits) for integer string conversion"
        if "digits" not in str(e):
            raise
        raise JSONNumberTooLong(f"holds an integer of more than {_int_digits()} digits (the most Python converts; "
                                "no count or id needs that many)") from None
    level = [obj] if isinstance(obj, (list, dict)) else []
    depth = 0
    while level:
        depth += 1
        if depth > max_depth:
            raise JSONTooDeep(f"nests arrays/objects too deeply (more than {max_depth} levels)")
        nxt = []
        for o in level:
            items = o.values() if isinstance(o, dict) else o
            if {list, dict} & set(map(type, items)):      # one C pass per array: rows of floats cost little
                nxt.extend(x for x in items if isinstance(x, (list, dict)))
        level = nxt
    return obj


def read_json_file(path: str | os.PathLike, what: str, *, error: type = BadInput, expected: str = "a JSON object",
                   max_bytes: int = MAX_FILE_BYTES) -> Any:
    """The parsed JSON of a file the user named (a config, a manifest, a saved server answer).

    Raises ``error`` (a :class:`helpers.errors.BadInput` subclass, default BadInput) with the path and ``what`` in
    one line when the file is missing, unreadable, not a regular file (a FIFO, ``/dev/zero``: never opened for a
    blocking read), over ``max_bytes`` (:data:`MAX_FILE_BYTES` by default; :func:`read_file_bytes`), not UTF-8, empty
    (``expected`` says what it should hold), not valid JSON (message, line and column), nested deeper than
    :data:`MAX_JSON_DEPTH` or holding an integer too long to convert (:class:`JSONNumberTooLong`). The one reader of
    user-named JSON files."""
    p = Path(path)
    text = read_file_text(p, what, max_bytes=max_bytes, error=error, expected=expected)
    if not text.strip():
        raise error(f"{what} is an empty file (expected {expected})", path=p)
    try:
        return loads_json(text)
    except json.JSONDecodeError as e:
        raise error(f"{what} is not valid JSON, or truncated ({e.msg} at line {e.lineno} column {e.colno})",
                    path=p) from None
    except JSONTooDeep as e:
        raise error(f"{what} {e} (expected {expected})", path=p) from None


def _int_digits() -> int:
    return sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 4300


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


#: Largest YAML document accepted, counted in nodes (scalars, sequences, mappings) after every alias is expanded:
#: what a reader of the file gets. The suite's files hold hundreds; a 10-line "billion laughs" alias bomb holds
#: 9^9 and, built and validated, takes gigabytes.
MAX_YAML_NODES = 200_000


class YAMLTooLarge(yaml.YAMLError):
    """A YAML document whose aliases expand past :data:`MAX_YAML_NODES` nodes, or refer to a node containing them."""


def _expanded_nodes(root: yaml.Node, limit: int) -> int:
    """Nodes of ``root`` with every alias expanded (an alias is the node it names, counted again each time), computed
    once per distinct node, without recursion. Raises :class:`YAMLTooLarge` past ``limit`` or on a cycle."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()

    def children(n: yaml.Node) -> list:
        if isinstance(n, yaml.MappingNode):
            return [x for pair in n.value for x in pair]
        return list(n.value) if isinstance(n, yaml.SequenceNode) else []

    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            on_path.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in children(node))
            if sizes[key] > limit:
                raise YAMLTooLarge(f"its aliases expand to more than {limit} values (an alias bomb?); write the "
                                   "values out or use fewer aliases")
            continue
        if key in sizes:
            continue
        on_path.add(key)
        stack.append((node, True))
        for c in children(node):
            if id(c) in on_path:
                raise YAMLTooLarge("an alias refers to a node that contains it (a recursive structure)")
            if id(c) not in sizes:
                stack.append((c, False))
    return sizes[id(root)]


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses documents expanding past :data:`MAX_YAML_NODES` nodes before building them."""

    def construct_document(self, node):
        _expanded_nodes(node, MAX_YAML_NODES)
        return super().construct_document(node)


def load_yaml_text(text: str, what: str, *, path: Any = None, error: type = None) -> Any:
    """Parse YAML text with safe types only and aliases bounded (:data:`MAX_YAML_NODES`): the one YAML parser.

    Raises:
        ``error`` (default :class:`helpers.errors.BadInput`): invalid YAML, or aliases that expand too far or refer
            to themselves; one line naming ``path`` (or ``what``) and what was wrong.
    """
    error = error or BadInput
    try:
        return yaml.load(text, Loader=_BoundedLoader)   # noqa: S506 - a SafeLoader subclass
    except RecursionError:      # "[[[[...": PyYAML's composer recurses once per level
        raise error(f"{what} nests sequences/mappings too deeply (more than Python's parser can follow)",
                    path=path) from None
    except YAMLTooLarge as exc:
        raise error(f"{what}: {exc}", path=path) from None
    except yaml.YAMLError as exc:
        raise error(f"{what} is not valid YAML ({' '.join(str(exc).split())})", path=path) from None
    except ValueError as exc:     # an int of more than 4300 digits: int() refuses it while the loader builds it
        if "digits" not in str(exc):
            raise
        raise error(f"{what} holds an integer of more than {_int_digits()} digits (the most Python converts)",
                    path=path) from None


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
        ``error``: missing or unreadable file, not UTF-8 text, invalid YAML (:func:`load_yaml_text`: also aliases
            that expand past :data:`MAX_YAML_NODES`), not a mapping, or an invalid field; one line naming the file and the field
            (``timeline.2.hypothesis.check``) and what was expected.
    """


    error = error or BadInput
    path = None
    data = source
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir():
            raise error(f"{what} expected, got a folder", path=path)
        if not path.exists() and not path.is_symlink():
            raise error(f"{what} does not exist", path=path)
        text = read_file_text(path, what, error=error, expected="YAML")    # regular, bounded, UTF-8
        data = load_yaml_text(text, what, path=path, error=error)
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


#: bytes of each safetensors file's tensor data hashed by :func:`safetensors_fingerprint`: two checkpoints of one
#: architecture have the same header and sizes, their first tensor's bytes differ
FINGERPRINT_BYTES = 1 << 20


def safetensors_fingerprint(f: Path) -> str:
    """sha256 (16 hex) of a safetensors file's header and its first :data:`FINGERPRINT_BYTES` of tensor data (a
    draft checkpoint's identity in a measurement's provenance, ``helpers.investigation.attach.same_model``).

    Raises: OSError: the file cannot be read."""
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        h.update(head + fh.read(min(n, 100 << 20) + FINGERPRINT_BYTES))
    return h.hexdigest()[:16]
