"""Hidden-state dumps: the project's own dump format (reader + atomic writer), SGLang ``/generate``
responses with ``meta_info.hidden_states``, and SGLang dumper files.

Every reader returns :class:`Sample` objects (rows aligned to tokens) grouped in a :class:`SampleSource`.
The tensors of a project dump are read lazily, one sample at a time (safetensors is memory-mapped), so a
comparison never holds more than the samples it is working on.

Project dump format (DESIGN.md "Dump format")::

    <dump>/manifest.json        {"format": "e3f-dump", "version": 1, "kind": ..., "samples": [...], ...}
    <dump>/tensors.safetensors  "<key>/hidden" [T, W]; "<key>/input_ids" [T] int64; optional "<key>/output_ids"

Row t of ``hidden`` belongs to token ``input_ids[t]`` at position ``first_position + t`` (``first_position``
is 0 unless the sample says otherwise, see :class:`Sample`).
"""
from __future__ import annotations

import errno
import gzip
import io
import json
import os
import pickle
import re
import struct
import warnings
import zipfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Optional

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from safetensors import safe_open

from ..errors import BadInput
from ..runfiles import atomic_write_text, loads_json, read_json_file, regular_file, staged_folder, write_safetensors

DUMP_FORMAT = "e3f-dump"
DUMP_VERSION = 1
DUMP_KINDS = ("served", "reference", "per_rank", "training")


# ------------------------------------------------------------------------------------------------ sample

@dataclass
class Sample:
    """One sequence of hidden-state rows aligned to tokens.

    Attributes:
        key: unique within its source (dump key, response ``meta_info.id``, file stem...).
        sample_id: the training sample it belongs to when the source says so (e.g. ``"data_12"``), else None.
        input_ids: int64 ``[T]``, the token of each row; None when the source does not carry prompt ids (a
            ``/generate`` response requested without ``return_prompt_token_ids``).
        first_position: sequence position of row 0 (> 0 when SGLang returned only the uncached / last-chunk
            suffix of the prompt: ``batch_result_processor.py::_append_prefill_hidden_states`` slices
            ``extend_input_len`` rows).
        num_prompt_tokens: prompt length P of the request (None if unknown).
        output_ids: generated ids (``/generate`` ``output_ids``), None if not a generation.
        tp_rank / tp_size: which tensor-parallel rank produced the rows (None = replicated / unknown).
        dtype: dtype name of the stored rows (``"float32"`` for JSON floats).
        width: W, the row width.
        rows: T.
        meta: anything else (layout, loss_mask, path...).
    """

    key: str
    rows: int
    width: int
    loader: Callable[[], torch.Tensor] = field(repr=False)
    input_ids: Optional[np.ndarray] = None
    sample_id: Optional[str] = None
    first_position: int = 0
    num_prompt_tokens: Optional[int] = None
    output_ids: Optional[list[int]] = None
    tp_rank: Optional[int] = None
    tp_size: Optional[int] = None
    dtype: str = "float32"
    meta: dict = field(default_factory=dict, repr=False)
    prefetch: Optional[Callable[[], None]] = field(default=None, repr=False)

    def load(self) -> torch.Tensor:
        """The hidden rows ``[rows, width]`` in their stored dtype (read now; not cached)."""
        return self.loader()

    def hint(self) -> None:
        """Ask the OS to start reading this sample's bytes in the background (no-op if unsupported)."""
        if self.prefetch is not None:
            self.prefetch()


def readahead(path: str | Path, offset: int = 0, length: int = 0) -> None:
    """``posix_fadvise(WILLNEED)``: the kernel reads the range into the page cache asynchronously, so disk
    reads of the next sample overlap the comparison of the current one. Silently does nothing where
    unsupported."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(str(path), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))    # a FIFO never blocks here
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
    except OSError:
        pass


def _safetensors_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """{tensor name: (absolute byte offset, length)} from a safetensors header (8-byte size + JSON)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = loads_json(f.read(n))
    return {k: (8 + n + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0])
            for k, v in header.items() if k != "__metadata__"}


@dataclass
class SampleSource:
    """A set of samples from one file / folder (one TP rank, or replicated rows).

    Attributes:
        path: where they came from.
        kind: ``served`` | ``reference`` | ``per_rank`` | ``training``.
        format: ``e3f-dump`` | ``sglang-generate`` | ``sglang-dumper`` | ``specforge`` | ``speculators`` | ``eagle12``.
        hidden_size: H if the source knows it, else None.
        dtype: dtype name of the rows.
        tp_rank / tp_size: for per-rank sources.
        layer_plan: ``{"tensors": [...], ...}`` when the source records which layers it holds.
        server: server settings recorded with a dump (no secrets), else None.
        sglang_version: if recorded.
    """

    path: Path
    kind: str
    format: str
    samples: list[Sample]
    hidden_size: Optional[int] = None
    dtype: Optional[str] = None
    tp_rank: Optional[int] = None
    tp_size: Optional[int] = None
    layer_plan: Optional[dict] = None
    server: Optional[dict] = None
    sglang_version: Optional[str] = None

    @property
    def width(self) -> Optional[int]:
        return self.samples[0].width if self.samples else None


# ------------------------------------------------------------------------------------------------ dumps

class ManifestSample(BaseModel):
    model_config = ConfigDict(extra="allow")
    key: str
    sample_id: Optional[str] = None
    num_prompt_tokens: Optional[int] = None
    num_output_tokens: Optional[int] = None
    rows: int = Field(ge=0)
    width: int = Field(gt=0)
    first_position: int = Field(default=0, ge=0)


class Manifest(BaseModel):
    """``manifest.json`` of a project dump (DESIGN.md). Extra keys are kept."""

    model_config = ConfigDict(extra="allow")
    format: Literal["e3f-dump"]
    version: int
    kind: Literal["served", "reference", "per_rank", "training"]
    created: str
    source: dict = Field(default_factory=dict)
    server: Optional[dict] = None
    sglang_version: Optional[str] = None
    tp_rank: Optional[int] = None
    tp_size: Optional[int] = None
    module: Optional[str] = None
    layer_plan: Optional[dict] = None
    hidden_size: Optional[int] = Field(None, gt=0)
    width: int = Field(gt=0)
    dtype: str
    samples: list[ManifestSample]

    @field_validator("samples")
    @classmethod
    def _unique_keys(cls, v: list[ManifestSample]) -> list[ManifestSample]:
        seen: set[str] = set()
        for s in v:
            if s.key in seen:
                raise ValueError(f"sample key {s.key!r} is listed twice (each sample's tensors are stored once)")
            seen.add(s.key)
        return v


_KEY_RE = re.compile(r"^[A-Za-z0-9_.:#=\-]+$")


def _as_int64(ids: Any, what: str) -> np.ndarray:
    arr = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{what}: expected a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def write_dump(path: str | Path, samples: Iterable[Any], manifest_extra: Optional[dict] = None) -> Path:
    """Write a project dump folder atomically; never overwrite an existing one.

    Args:
        path: the dump folder to create (must not exist).
        samples: :class:`Sample` objects or dicts with ``key``, ``hidden`` ``[T, W]`` tensor, ``input_ids``
            ``[T]``, and optional ``sample_id``, ``output_ids``, ``num_prompt_tokens``, ``first_position``.
        manifest_extra: manifest fields: ``kind`` (default ``"served"``), ``source``, ``server`` (no secrets),
            ``sglang_version``, ``tp_rank``, ``tp_size``, ``module``, ``layer_plan``, ``hidden_size``, extras.

    Returns:
        ``path``.

    Raises:
        FileExistsError: ``path`` exists.
        ValueError: samples are empty, keys are duplicated or unsafe, shapes/widths/dtypes are inconsistent.

    The folder is built under a temporary sibling name and renamed into place; the existence check runs
    just before the rename (no overwrite; a concurrent writer of the same name loses with FileExistsError).
    """

    path = Path(path)
    if path.exists():
        raise FileExistsError(errno.EEXIST, "the dump folder exists (dumps are never overwritten)", str(path))
    extra = dict(manifest_extra or {})
    kind = extra.pop("kind", "served")
    if kind not in DUMP_KINDS:
        raise ValueError(f"kind must be one of {DUMP_KINDS}, got {kind!r}")
    tensors: dict[str, torch.Tensor] = {}
    entries: list[dict] = []
    width = None
    dtype = None
    for s in samples:
        if isinstance(s, Sample):
            d = {"key": s.key, "hidden": s.load(), "input_ids": s.input_ids, "sample_id": s.sample_id,
                 "output_ids": s.output_ids, "num_prompt_tokens": s.num_prompt_tokens,
                 "first_position": s.first_position}
        else:
            d = dict(s)
        key = str(d["key"])
        if not _KEY_RE.match(key) or "/" in key:
            raise ValueError(f"sample key {key!r}: use letters, digits and _.:#=- only")
        if f"{key}/hidden" in tensors:
            raise ValueError(f"duplicate sample key {key!r}")
        hidden = d["hidden"]
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
            raise ValueError(f"sample {key!r}: hidden must be a 2-D tensor [T, W]")
        if d.get("input_ids") is None:
            raise ValueError(f"sample {key!r}: input_ids are required (rows are aligned by token)")
        ids = _as_int64(d["input_ids"], f"sample {key!r} input_ids")
        if ids.shape[0] != hidden.shape[0]:
            raise ValueError(f"sample {key!r}: {hidden.shape[0]} rows but {ids.shape[0]} input_ids")
        if width is None:
            width, dtype = int(hidden.shape[1]), hidden.dtype
        elif hidden.shape[1] != width or hidden.dtype != dtype:
            raise ValueError(f"sample {key!r}: width/dtype {tuple(hidden.shape)}/{hidden.dtype} differs from "
                             f"the first sample's {width}/{dtype}")
        tensors[f"{key}/hidden"] = hidden.detach().contiguous().cpu()
        tensors[f"{key}/input_ids"] = torch.from_numpy(np.ascontiguousarray(ids))
        out_ids = d.get("output_ids")
        if out_ids is not None:
            tensors[f"{key}/output_ids"] = torch.from_numpy(np.ascontiguousarray(_as_int64(out_ids, "output_ids")))
        entry = {"key": key, "sample_id": d.get("sample_id"), "num_prompt_tokens": d.get("num_prompt_tokens"),
                 "num_output_tokens": None if out_ids is None else len(out_ids),
                 "rows": int(hidden.shape[0]), "width": int(hidden.shape[1])}
        if d.get("first_position"):
            entry["first_position"] = int(d["first_position"])
        entries.append(entry)
    if not entries:
        raise ValueError("no samples to write")
    manifest = {"format": DUMP_FORMAT, "version": DUMP_VERSION, "kind": kind,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "source": extra.pop("source", {}), "server": extra.pop("server", None),
                "sglang_version": extra.pop("sglang_version", None), "tp_rank": extra.pop("tp_rank", None),
                "tp_size": extra.pop("tp_size", None), "module": extra.pop("module", None),
                "layer_plan": extra.pop("layer_plan", None), "hidden_size": extra.pop("hidden_size", None),
                "width": width, "dtype": str(dtype).replace("torch.", ""), **extra, "samples": entries}
    Manifest.model_validate(manifest)
    with staged_folder(path) as tmp:
        write_safetensors(tmp / "tensors.safetensors", tensors, metadata={"format": DUMP_FORMAT})
        atomic_write_text(tmp / "manifest.json", json.dumps(manifest, indent=1))
        if path.exists():
            raise FileExistsError(errno.EEXIST, "the dump folder appeared while writing (not overwritten)", str(path))
        os.rename(tmp, path)
    return path


def read_dump(path: str | Path) -> SampleSource:
    """Open a project dump folder; tensors are read lazily per sample.

    Raises:
        BadInput: missing/empty/invalid manifest (names the field), missing or corrupt tensors file, a tensor
            missing or with a shape different from the manifest's.
    """

    p = Path(path)
    mpath = p / "manifest.json"
    tpath = p / "tensors.safetensors"
    if not mpath.exists():
        raise BadInput("not a dump folder (no manifest.json)", path=p)
    raw = read_json_file(mpath, "manifest", expected="the e3f-dump JSON manifest")
    try:
        man = Manifest.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise BadInput(f"{err['msg']} (expected an e3f-dump version {DUMP_VERSION} manifest)",
                       path=mpath, field=loc) from None
    if man.version != DUMP_VERSION:
        raise BadInput(f"dump version {man.version} is not supported (expected {DUMP_VERSION})", path=mpath,
                       field="version")
    if regular_file(tpath, "tensors file").stat().st_size == 0:
        raise BadInput("missing or empty tensors file", path=tpath)
    try:
        with safe_open(str(tpath), framework="pt") as sf:
            shapes = {k: tuple(sf.get_slice(k).get_shape()) for k in sf.keys()}
            dtypes = {k: sf.get_slice(k).get_dtype() for k in sf.keys() if k.endswith("/hidden")}
    except Exception as e:
        raise BadInput(f"corrupt or truncated safetensors file ({' '.join(str(e).split())})", path=tpath) from None
    for k, dt in dtypes.items():
        plain_float_states(dt, tpath, k)
    try:
        offsets = _safetensors_offsets(tpath)
    except Exception:
        offsets = {}
    samples = []
    for ms in man.samples:
        for name, want in ((f"{ms.key}/hidden", (ms.rows, ms.width)), (f"{ms.key}/input_ids", (ms.rows,))):
            if name not in shapes:
                raise BadInput("tensor listed in the manifest is missing", path=tpath, field=name)
            if shapes[name] != want:
                raise BadInput(f"shape {list(shapes[name])} differs from the manifest's {list(want)}",
                               path=tpath, field=name)
        if ms.width != man.width:
            raise BadInput(f"width {ms.width} differs from the dump width {man.width}", path=mpath,
                           field=f"samples[{ms.key}].width")
        with safe_open(str(tpath), framework="pt") as sf:
            ids = sf.get_tensor(f"{ms.key}/input_ids").numpy().astype(np.int64)
            out_ids = (sf.get_tensor(f"{ms.key}/output_ids").tolist()
                       if f"{ms.key}/output_ids" in shapes else None)
        samples.append(Sample(key=ms.key, rows=ms.rows, width=ms.width, loader=_dump_loader(tpath, ms.key),
                              input_ids=ids, sample_id=ms.sample_id, first_position=ms.first_position,
                              num_prompt_tokens=ms.num_prompt_tokens, output_ids=out_ids, tp_rank=man.tp_rank,
                              tp_size=man.tp_size, dtype=man.dtype, meta={"path": str(p)},
                              prefetch=_prefetcher(tpath, offsets.get(f"{ms.key}/hidden"))))
    if not samples:
        raise BadInput("the dump lists no samples", path=mpath, field="samples")
    return SampleSource(path=p, kind=man.kind, format=DUMP_FORMAT, samples=samples, hidden_size=man.hidden_size,
                        dtype=man.dtype, tp_rank=man.tp_rank, tp_size=man.tp_size, layer_plan=man.layer_plan,
                        server=man.server, sglang_version=man.sglang_version)


def _prefetcher(tpath: Path, span: Optional[tuple[int, int]]) -> Optional[Callable[[], None]]:
    if span is None:
        return None
    return lambda: readahead(tpath, span[0], span[1])


def _dump_loader(tpath: Path, key: str) -> Callable[[], torch.Tensor]:
    def load() -> torch.Tensor:
        with safe_open(str(tpath), framework="pt") as sf:
            return sf.get_tensor(f"{key}/hidden")
    return load


# ------------------------------------------------------------------------------------- /generate JSON

def _rows_array(block: Any, where: str, path: Path) -> np.ndarray:
    """Rows as float32. SGLang serialises responses with orjson (``srt/utils/json_response.py::dumps_json``),
    which writes NaN and Inf as ``null``: nulls are read back as NaN."""
    try:
        return np.asarray(block, dtype=np.float32)
    except (ValueError, TypeError):
        pass
    try:
        obj = np.array(block, dtype=object)
        if obj.dtype == object and obj.ndim >= 1 and not any(isinstance(v, list) for v in obj.flat):
            obj[np.equal(obj, None)] = np.nan
            return obj.astype(np.float32)
    except (ValueError, TypeError):
        pass
    raise BadInput("rows are not a rectangular list of numbers", path=path, field=where)


def samples_from_generate(obj: Any, *, source: str | Path = "<response>", tp_rank: Optional[int] = None,
                          tp_size: Optional[int] = None) -> list[Sample]:
    """Samples from parsed SGLang ``/generate`` response(s) with ``meta_info.hidden_states``.

    Args:
        obj: one response dict, or a list of them (in training-sample order when there are no
            ``prompt_token_ids``).
        source: file name used in error messages and sample keys.

    Layout mirrored (SGLang 0.5.23, ``sglang/srt/managers/scheduler_components/batch_result_processor.py``):
      * ``meta_info.hidden_states[0]`` is the prompt block, a 2-D list ``[P', W]`` (one row per prompt
        token of the last prefill forward: ``batch_result_processor.py::_append_prefill_hidden_states``);
        ``P' < P`` when part of the prompt was cached or chunked, and the block is then the prompt's suffix;
      * each later element is one 1-D row: the hidden state at the input position that produced the next
        output token (``_append_decode_hidden_states``), so rows = prompt + ``output_ids[:-1]``;
      * ``prompt_token_ids`` (top level) is present when requested with ``return_prompt_token_ids``
        (``tokenizer_manager.py``); P is ``len(prompt_token_ids)`` or ``meta_info.prompt_tokens``.

    Raises:
        BadInput: not a response, no/empty ``hidden_states`` (server flag or request flag missing, or a
            STANDALONE/"last" capture), ragged rows, or counts inconsistent with ``output_ids``.
    """
    path = Path(str(source))
    items = obj if isinstance(obj, list) else [obj]
    if not items:
        raise BadInput("empty list (expected /generate responses)", path=path)
    out: list[Sample] = []
    width = None
    for n, r in enumerate(items):
        where = f"[{n}]" if isinstance(obj, list) else ""
        if not isinstance(r, dict) or not isinstance(r.get("meta_info"), dict):
            raise BadInput("not a /generate response (expected an object with meta_info)", path=path,
                           field=where or None)
        mi = r["meta_info"]
        hs = mi.get("hidden_states")
        if hs is None:
            raise BadInput("no hidden states (send return_hidden_states=true to a server started with "
                           "--enable-return-hidden-states)", path=path, field=f"{where}meta_info.hidden_states")
        if not isinstance(hs, list) or not hs:
            raise BadInput("empty hidden_states list (STANDALONE captures nothing)", path=path,
                           field=f"{where}meta_info.hidden_states")
        if not (isinstance(hs[0], list) and hs[0] and isinstance(hs[0][0], list)):
            raise BadInput("the first element is not a 2-D prompt block (a request with "
                           "return_hidden_states='last' keeps only one row; request full hidden states)",
                           path=path, field=f"{where}meta_info.hidden_states[0]")
        prompt = _rows_array(hs[0], f"{where}meta_info.hidden_states[0]", path)
        if prompt.ndim != 2:
            raise BadInput("prompt block rows have different widths", path=path,
                           field=f"{where}meta_info.hidden_states[0]")
        dec = _rows_array(hs[1:], f"{where}meta_info.hidden_states[1:]", path) if len(hs) > 1 else \
            np.zeros((0, prompt.shape[1]), np.float32)
        if dec.ndim != 2 or dec.shape[1] != prompt.shape[1]:
            raise BadInput(f"decode rows are not 1-D rows of width {prompt.shape[1]}", path=path,
                           field=f"{where}meta_info.hidden_states[1:]")
        w = prompt.shape[1]
        if width is not None and w != width:
            raise BadInput(f"row width {w} differs from the first response's {width}", path=path, field=where or None)
        width = w
        out_ids = r.get("output_ids")
        if out_ids is not None and not (isinstance(out_ids, list) and all(isinstance(i, int) for i in out_ids)):
            raise BadInput("expected a list of token ids", path=path, field=f"{where}output_ids")
        if out_ids is not None and len(hs) - 1 != max(len(out_ids) - 1, 0):
            raise BadInput(f"{len(hs) - 1} decode rows but {len(out_ids)} output_ids (expected len(output_ids)-1 "
                           "rows after the prompt block)", path=path, field=f"{where}meta_info.hidden_states")
        pids = r.get("prompt_token_ids")
        if pids is not None and not (isinstance(pids, list) and all(isinstance(i, int) for i in pids)):
            raise BadInput("expected a list of token ids", path=path, field=f"{where}prompt_token_ids")
        P = len(pids) if pids is not None else mi.get("prompt_tokens")
        if not isinstance(P, int) or P < prompt.shape[0]:
            raise BadInput(f"prompt block has {prompt.shape[0]} rows but the prompt has {P} tokens",
                           path=path, field=f"{where}meta_info.prompt_tokens")
        first = P - prompt.shape[0]
        ids = None
        if pids is not None:
            ids = np.asarray(list(pids[first:]) + list((out_ids or [])[:-1]), dtype=np.int64)
        rows = np.concatenate([prompt, dec], axis=0)
        tensor = torch.from_numpy(rows)
        key = str(mi.get("id") or f"{path.stem}#{n}")
        out.append(Sample(key=key, rows=rows.shape[0], width=w, loader=(lambda t=tensor: t), input_ids=ids,
                          first_position=first, num_prompt_tokens=P, output_ids=out_ids, tp_rank=tp_rank,
                          tp_size=tp_size, dtype="float32",
                          meta={"order": n, "path": str(path), "cached_tokens": mi.get("cached_tokens")}))
    keys = [s.key for s in out]
    if len(set(keys)) != len(keys):
        for s in out:
            s.key = f"{s.key}#{s.meta['order']}"
    return out


#: the largest saved ``/generate`` answer read: the client's own ``/generate`` limit
#: (``helpers.server.client.MAX_GENERATE_BYTES``, 1 GiB; a TP 8 capture of a 2k-token prompt is ~500 MiB)
MAX_GENERATE_FILE_BYTES = 1 << 30


def read_generate_response(path: str | Path, *, tp_rank: Optional[int] = None,
                           tp_size: Optional[int] = None) -> SampleSource:
    """Read a JSON file holding one SGLang ``/generate`` response or a list of them.

    Raises:
        BadInput: missing/empty/invalid JSON, or see :func:`samples_from_generate`.
    """
    p = Path(path)
    obj = read_json_file(p, "saved /generate response", expected="a /generate response JSON",
                         max_bytes=MAX_GENERATE_FILE_BYTES)
    samples = samples_from_generate(obj, source=p, tp_rank=tp_rank, tp_size=tp_size)
    return SampleSource(path=p, kind="served", format="sglang-generate", samples=samples, dtype=None,
                        tp_rank=tp_rank, tp_size=tp_size)


# ---------------------------------------------------------------------------------------- dumper files

@dataclass
class DumperRecord:
    """One SGLang dumper ``.pt`` file: ``{"value", "meta"}`` payload plus the filename tags.

    Format mirrored: ``sglang/srt/debug_utils/dumper.py::_Dumper._dump_single`` (0.5.23) writes
    ``{dir}/{exp}/step={s}___rank={r}___dump_index={k}___name={n}___...pt`` holding
    ``{"value": tensor, "meta": {**tags, world_rank, world_size, sglang_parallel_info, ...}}``.
    """

    path: Path
    tags: dict
    value: Any
    meta: dict

    @property
    def name(self) -> str:
        return str(self.meta.get("name", self.tags.get("name", "")))

    @property
    def step(self) -> int:
        return int(self.meta.get("step", self.tags.get("step", 0)))

    @property
    def tp_rank(self) -> Optional[int]:
        info = self.meta.get("sglang_parallel_info") or {}
        for v in (info.get("tp_rank"), self.meta.get("tp_rank"), self.tags.get("tp_rank")):
            if v is not None:
                return int(v)
        r = self.meta.get("rank", self.tags.get("rank"))
        return None if r is None else int(r)

    @property
    def tp_size(self) -> Optional[int]:
        info = self.meta.get("sglang_parallel_info") or {}
        v = info.get("tp_size", self.meta.get("world_size"))
        return None if v is None else int(v)


def parse_dumper_filename(name: str) -> dict:
    """``"step=3___rank=0___name=x.pt"`` -> ``{"step": 3, "rank": 0, "name": "x"}`` (ints converted).

    Mirrors ``sglang/srt/debug_utils/dump_loader.py::parse_meta_from_filename``.
    """
    stem = name[:-3] if name.endswith(".pt") else name
    tags: dict = {}
    for kv in stem.split("___"):
        if "=" in kv:
            k, v = kv.split("=", 1)
            tags[k] = int(v) if re.fullmatch(r"-?\d+", v) else v
    return tags


def read_dumper_file(path: str | Path) -> DumperRecord:
    """Load one dumper file with ``torch.load(weights_only=True)``: a pickled object payload is refused.

    Raises:
        BadInput: empty, truncated, not a dumper payload, or refused by the weights-only unpickler.
    """
    p = Path(path)
    raw = safe_torch_load(p)
    if not isinstance(raw, dict) or "value" not in raw:
        raise BadInput("not an SGLang dumper payload (expected a dict with 'value' and 'meta')", path=p)
    meta = raw.get("meta") or {}
    if not isinstance(meta, dict):
        raise BadInput("expected a dict", path=p, field="meta")
    return DumperRecord(path=p, tags=parse_dumper_filename(p.name), value=raw["value"], meta=meta)


def read_dumper_dir(path: str | Path, *, name: str = "aux_hidden_states",
                    ids_name: str = "input_ids", positions_name: str = "positions") -> list[SampleSource]:
    """Served samples from an SGLang dumper folder: one :class:`SampleSource` per TP rank.

    Args:
        path: the exp folder holding ``*.pt`` files (a single sub-folder is descended into, like SGLang's
            comparator does).
        name: the dump name holding the aux hidden states ``[tokens, W]`` (e.g. a source-patched
            ``dumper.dump("aux_hidden_states", torch.cat(aux, -1))``).
        ids_name / positions_name: the non-intrusive ``core`` dumps of the same step and rank.

    Each step's rows are split into requests where ``positions`` restart (an extend batch concatenates
    requests); each request becomes one :class:`Sample` with ``first_position = positions[0]``.

    Raises:
        BadInput: no ``.pt`` files, no record named ``name``, a step without ``input_ids``, or mismatched
            row counts.
    """
    p = Path(path)
    files = sorted(p.glob("*.pt"))
    if not files:
        subs = [d for d in p.iterdir() if d.is_dir()] if p.is_dir() else []
        if len(subs) == 1:
            return read_dumper_dir(subs[0], name=name, ids_name=ids_name, positions_name=positions_name)
        raise BadInput("no SGLang dumper .pt files found", path=p)
    recs = [read_dumper_file(f) for f in files]
    by: dict[tuple[int, Optional[int]], dict[str, DumperRecord]] = {}
    for r in recs:
        by.setdefault((r.step, r.tp_rank), {})[r.name] = r
    ranks: dict[Optional[int], list[Sample]] = {}
    sizes: dict[Optional[int], Optional[int]] = {}
    found = False
    for (step, rank), named in sorted(by.items(), key=lambda kv: (kv[0][0], -1 if kv[0][1] is None else kv[0][1])):
        if name not in named:
            continue
        found = True
        rec = named[name]
        val = rec.value
        if isinstance(val, (list, tuple)):
            val = torch.cat([v for v in val], dim=-1)
        if not isinstance(val, torch.Tensor) or val.dim() != 2:
            raise BadInput(f"expected a 2-D tensor [tokens, W], got {getattr(val, 'shape', type(val))}",
                           path=rec.path, field="value")
        if ids_name not in named:
            raise BadInput(f"no '{ids_name}' dump for step {step} rank {rank} (enable the dumper's core "
                           "non-intrusive mode)", path=rec.path)
        ids = _as_int64(named[ids_name].value, f"{named[ids_name].path} value")
        if ids.shape[0] != val.shape[0]:
            raise BadInput(f"{val.shape[0]} rows but {ids.shape[0]} input_ids in step {step}", path=rec.path)
        pos = (_as_int64(named[positions_name].value, "positions") if positions_name in named
               else np.arange(ids.shape[0], dtype=np.int64))
        starts = [0] + [t for t in range(1, len(pos)) if pos[t] <= pos[t - 1]] + [len(pos)]
        for a, b in zip(starts[:-1], starts[1:]):
            chunk = val[a:b]
            ranks.setdefault(rank, []).append(Sample(
                key=f"step={step}#{a}", rows=b - a, width=int(val.shape[1]), loader=(lambda t=chunk: t),
                input_ids=ids[a:b].copy(), first_position=int(pos[a]), tp_rank=rank, tp_size=rec.tp_size,
                dtype=str(val.dtype).replace("torch.", ""), meta={"path": str(rec.path)}))
        sizes[rank] = rec.tp_size
    if not found:
        raise BadInput(f"no dumper record named '{name}'", path=p)
    return [SampleSource(path=p, kind="per_rank" if len(ranks) > 1 else "served", format="sglang-dumper",
                         samples=s, dtype=s[0].dtype, tp_rank=r, tp_size=sizes.get(r))
            for r, s in sorted(ranks.items(), key=lambda kv: -1 if kv[0] is None else kv[0])]


# ---------------------------------------------------------------------------------------- safe loading

def _utf8_name(path: Path) -> bool:
    """True when ``path`` is valid UTF-8 (a file name of other bytes decodes with surrogates in Python)."""
    try:
        os.fsencode(path).decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


#: the dtypes hidden states and draft weights are read in (SGLang's unquantised paths hold these); an FP8 / integer
#: tensor is a quantised one whose scales live elsewhere (``draft.model`` refuses such weights, the readers here such
#: states): every figure computed from it would be of other numbers
PLAIN_FLOAT = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: the same as safetensors header dtype names
PLAIN_FLOAT_HEADER = ("F32", "BF16", "F16", "F64")


def plain_float_states(dtype: Any, path: str | Path, name: str) -> None:
    """Raise :class:`BadInput` naming ``path [name]`` when hidden states of ``dtype`` (a torch dtype or a safetensors
    header name such as ``F8_E4M3``) are not a plain float tensor: FP8 training / served states (the trainers and
    SGLang's ``return_hidden_states`` keep them in the model's float dtype; an FP8 copy carries scales this tool
    does not know, and torch computes few operations on float8 at all), integer or bool tensors."""
    if dtype in PLAIN_FLOAT or dtype in PLAIN_FLOAT_HEADER:
        return
    shown = str(dtype).replace("torch.", "")
    raise BadInput(f"dtype {shown}: not plain float hidden states (an FP8-quantised copy, or a mistyped tensor); the "
                   "comparison reads float32 / bfloat16 / float16 states only (save them in the model's float dtype, "
                   "or dequantise them with their scales)", path=path, field=name)


def safe_torch_load(path: str | Path) -> Any:
    """``torch.load(weights_only=True)`` of a ``.pt``/``.ckpt`` or gzip ``.ckpt.gz`` file, never executing
    a pickled payload (the weights-only unpickler accepts tensors, containers and primitives only).

    Uncompressed zip-format files are memory-mapped (``mmap=True``) so a large sample is not copied (not when the
    file name is not UTF-8, which torch's mmap cannot open: such a file is read whole).

    Raises:
        BadInput: empty, truncated/corrupt (zip, gzip or pickle), or refused by the weights-only unpickler
            (the message says the payload was not executed).
    """

    p = regular_file(path, "torch.save file")     # a FIFO or /dev/zero is never opened
    if p.stat().st_size == 0:
        raise BadInput("empty file (expected a torch.save payload)", path=p)

    def _load(src, mm: bool):
        with warnings.catch_warnings():   # legacy (non-zip) pickles warn about their protocol; not actionable
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            return torch.load(src, map_location="cpu", weights_only=True, mmap=mm)

    try:
        if p.name.endswith(".gz"):
            with gzip.open(p, "rb") as f:
                data = f.read()
            if not data:
                raise BadInput("empty gzip payload", path=p)
            return _load(io.BytesIO(data), False)
        if not _utf8_name(p):        # torch's mmap needs a UTF-8 file name: read through an open file instead
            with open(p, "rb") as f:
                return _load(f, False)
        return _load(p, zipfile.is_zipfile(p))
    except BadInput:
        raise
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        why = next((ln.strip() for ln in first if "GLOBAL" in ln or "Unsupported" in ln), first[0] if first else "")
        raise BadInput(f"refused: the pickle holds objects other than tensors/containers and was NOT executed "
                       f"(torch.load weights_only=True: {why[:160]})", path=p) from None
    except (EOFError, OSError, RuntimeError, zipfile.BadZipFile, ValueError) as e:
        raise BadInput(f"truncated or corrupt file ({type(e).__name__}: {' '.join(str(e).split())[:160]})",
                       path=p) from None


# ----------------------------------------------------------------------------------------- dispatcher

def load_served(path: str | Path, *, tp_rank: Optional[int] = None) -> list[SampleSource]:
    """Open one ``--served`` path: a project dump folder, a ``/generate`` JSON file, or a dumper folder.

    Returns a list (a dumper folder may hold several TP ranks).

    Raises:
        BadInput: the path does not exist, is not a folder or a regular file (a FIFO, a device, a symlink loop:
            :func:`helpers.runfiles.regular_file`), or is none of the above.
    """
    p = Path(path)
    if not p.exists() and not p.is_symlink():
        raise BadInput("not found (expected a dump folder, a /generate response JSON or an SGLang dumper folder)",
                       path=p)
    if not p.is_dir():
        regular_file(p, "served data")      # a FIFO, /dev/zero, a symlink loop: said as what it is
    if p.is_dir():
        if (p / "manifest.json").exists():
            src = read_dump(p)
            if tp_rank is not None and src.tp_rank is None:
                src.tp_rank = tp_rank
            return [src]
        return read_dumper_dir(p)
    if p.suffix == ".json":
        return [read_generate_response(p, tp_rank=tp_rank)]
    if p.stat().st_size == 0:
        raise BadInput("empty file", path=p)
    raise BadInput("unrecognised served data (expected a dump folder with manifest.json, a .json /generate "
                   "response, or an SGLang dumper folder)", path=p)
