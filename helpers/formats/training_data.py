"""Readers for the aux hidden states a draft was trained on, streamed one sample at a time.

Formats (each with the writer it mirrors):

* SpecForge ``rows_{g}-{g+G}/data_{idx}.ckpt`` (or ``.ckpt.gz``): ``torch.save`` dict with ``input_ids [L]``,
  ``loss_mask [L]``, ``aux_hidden_state [1, L, 3*H]``, ``hidden_state [1, L, H]`` (post-norm), right-padded
  with id 0 / loss_mask 0 (``scripts/prepare_hidden_states.py``, ``HiddenStatesGenerator._save_tensor_sync``;
  key set ``specforge/runtime/data_plane/offline_reader.py::_OFFLINE_EAGLE3_KEYS``).
* speculators ``hs_{idx}.safetensors``: ``token_ids [L]``, ``hidden_states [L, slots, H]``; training uses
  ``hs[:, :-1].flatten(1)`` as the aux features (``src/speculators/train/data.py``).
* EAGLE-1/2 ``data_{idx}.ckpt``: ``{"input_ids": [L], "hidden_state": [L, H], "loss_mask": [L]}`` (top layer,
  ``eagle/ge_data/ge_data_all_llama3.py``: ``outs.hidden_states[-1]``, which transformers' ``LlamaModel.forward``
  appends after the final norm): one chunk, the target's post-norm final hidden state.
* the project's own dump format with ``kind: "training"``: a sample's loss mask is its continuation, 1 on every
  row whose position is ``num_prompt_tokens`` or later (the response tokens a chat-template trainer masks in, as
  SpecForge's ``loss_mask`` marks the assistant turn: ``specforge/data/preprocessing.py::preprocess_conversations``), none when the dump does
  not record ``num_prompt_tokens`` (:func:`dump_loss_mask`).

``.ckpt`` files are loaded ONLY with ``torch.load(weights_only=True)``: a pickled object payload is refused
(:class:`helpers.errors.BadInput`), never executed.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch
from safetensors import safe_open

from ..errors import BadInput
from ..runfiles import MAX_TOKEN_ID, loads_json, regular_file
from .dumps import Sample, SampleSource, plain_float_states, read_dump, readahead, safe_torch_load
from .rows import data_manifest

_NUM_RE = re.compile(r"(\d+)")


def _natural_key(p: Path) -> list:
    return [int(t) if t.isdigit() else t for t in _NUM_RE.split(str(p))]


def list_training_files(path: str | Path) -> tuple[str, list[Path]]:
    """Find the training files under ``path`` (a file or a folder, searched recursively).

    Returns:
        (layout, files) with layout ``"ckpt"`` (SpecForge or EAGLE-1/2, told apart when a file is read),
        ``"speculators"`` or ``"e3f-dump"``; files in natural order of their index (``data_2`` before
        ``data_10``).

    Raises:
        BadInput: nothing recognisable found; ``path`` or a file of a sample's name under it missing or not a
            regular file (a FIFO, a device, a symlink loop: :func:`helpers.runfiles.regular_file`, naming it).
    """
    p = Path(path)
    if not p.is_dir():
        regular_file(p, "training data")        # missing, a symlink loop, a FIFO, a device: named, never skipped
    if p.is_dir() and (p / "manifest.json").exists():
        return "e3f-dump", [p]
    if p.is_file():
        if p.name.endswith((".ckpt", ".ckpt.gz", ".pt")):
            return "ckpt", [p]
        if p.suffix == ".safetensors":
            return "speculators", [p]
        raise BadInput("unrecognised training file (expected data_*.ckpt[.gz], hs_*.safetensors or a dump folder)",
                       path=p)
    # every file of a sample's name is a sample: one that is not a regular file (a FIFO, a link to /dev/zero, a
    # symlink loop) is refused naming it (helpers.runfiles.regular_file), never dropped without a word
    ckpts = [regular_file(f, "training file") for f in p.rglob("*")
             if f.name.endswith((".ckpt", ".ckpt.gz")) and not f.is_dir()]
    # SpecForge's vocab_mapping/vocab_mapping.pt is not a sample (its reader globs *.ckpt only).
    hs = [regular_file(f, "training file") for f in p.rglob("hs_*.safetensors") if not f.is_dir()]
    if ckpts and hs:
        raise BadInput("both .ckpt and hs_*.safetensors files found; point --training at one data set", path=p)
    if ckpts:
        return "ckpt", sorted(ckpts, key=_natural_key)
    if hs:
        return "speculators", sorted(hs, key=_natural_key)
    raise BadInput("no training files found (expected SpecForge data_*.ckpt[.gz], speculators hs_*.safetensors, "
                   "EAGLE data_*.ckpt or a dump folder)", path=p)


def _strip_trailing_pad(ids: np.ndarray, loss_mask: Optional[np.ndarray]) -> int:
    """Length without SpecForge's right padding (trailing id 0 with loss_mask 0)."""
    L = ids.shape[0]
    if loss_mask is None:
        return L
    while L > 0 and ids[L - 1] == 0 and loss_mask[L - 1] == 0:
        L -= 1
    return L


def _ids(t, path: Path, key: str, *, allow_float: bool = False) -> np.ndarray:
    """A 1-D (or ``[1, L]``) tensor of token ids (or, ``allow_float``, a loss mask: bool, int or float) as int64.

    Raises:
        BadInput: not a tensor or a list of numbers, not 1-D, a dtype other than an integer (bool / float also
            allowed for a mask), or, for token ids, an id outside ``[0, 2^31)``; naming the file and the key."""
    if not isinstance(t, torch.Tensor):
        try:
            t = torch.as_tensor(t)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            raise BadInput(f"expected a 1-D integer tensor, got {type(t).__name__}", path=path, field=key) from None
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    ok = (not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool) or \
        (allow_float and not t.is_complex())
    if t.dim() != 1 or not ok:
        raise BadInput(f"expected a 1-D integer tensor, got {tuple(t.shape)} {t.dtype}", path=path, field=key)
    out = t.numpy().astype(np.int64)
    if not allow_float and len(out) and not (0 <= out.min() and out.max() < MAX_TOKEN_ID):
        bad = int(out[(out < 0) | (out >= MAX_TOKEN_ID)][0])
        raise BadInput(f"token id {bad} is not from 0 to {MAX_TOKEN_ID - 1}", path=path, field=key)
    return out


def _chunks(width: int, hidden_size: Optional[int], default_chunks: int, path: Path, key: str) -> tuple[int, int]:
    if width < 1:
        raise BadInput("rows are 0 wide (expected the aux hidden states, num_chunks x hidden size)", path=path,
                       field=key)
    if hidden_size:
        if width % hidden_size:
            raise BadInput(f"width {width} is not a multiple of the target hidden size {hidden_size}", path=path,
                           field=key)
        return hidden_size, width // hidden_size
    if width % default_chunks:
        raise BadInput(f"width {width} is not divisible into {default_chunks} chunks; pass the target config",
                       path=path, field=key)
    return width // default_chunks, default_chunks


def sample_key(path: Path) -> str:
    """A training file's sample key: its name up to the first ``.`` (``data_12`` for ``data_12.ckpt``), with bytes
    that are not UTF-8 written ``#xx`` (a name such as ``data_\\xff.ckpt``: a key goes into JSON and dump tensor
    names, which must be text)."""
    stem = path.name.split(".")[0]
    raw = os.fsencode(stem)
    try:
        raw.decode("utf-8")
        return stem
    except UnicodeDecodeError:
        return "".join(chr(b) if b < 0x80 else f"#{b:02x}" for b in raw)


def read_ckpt_sample(path: str | Path, *, hidden_size: Optional[int] = None) -> Sample:
    """Read one SpecForge ``data_*.ckpt[.gz]`` (or EAGLE-1/2 ``data_*.ckpt``) sample.

    Args:
        hidden_size: target H if known (else SpecForge's 3 chunks are assumed: its planner requires exactly 3
            ids; EAGLE-1/2 files are one chunk).

    Returns:
        A :class:`Sample` whose rows are ``aux_hidden_state[0, :L]`` (SpecForge) or ``hidden_state[:L]``
        (EAGLE-1/2), L without trailing padding; ``meta`` has ``layout``, ``hidden_size``, ``num_chunks``,
        ``loss_mask``, ``padded_len`` and ``final_hidden`` (SpecForge's ``hidden_state [L, H]``, the target's
        post-norm last hidden state, from which its next-token distribution is ``final_hidden @ lm_head.T``; for
        EAGLE-1/2 files their ``hidden_state``, the same post-norm state).

    Raises:
        BadInput: unsafe/corrupt/empty file, missing keys, inconsistent lengths, width not divisible.
    """
    p = Path(path)
    d = safe_torch_load(p)
    if not isinstance(d, dict):
        raise BadInput(f"expected a dict of tensors, got {type(d).__name__}", path=p)
    if "input_ids" not in d:
        raise BadInput("missing key (expected SpecForge input_ids/loss_mask/aux_hidden_state/hidden_state or "
                       "EAGLE input_ids/hidden_state/loss_mask)", path=p, field="input_ids")
    ids = _ids(d["input_ids"], p, "input_ids")
    lm = d.get("loss_mask")
    lm = None if lm is None else _ids(lm, p, "loss_mask", allow_float=True)
    if "aux_hidden_state" in d:
        layout, key, default_chunks = "specforge", "aux_hidden_state", 3
    elif "hidden_state" in d:
        layout, key, default_chunks = "eagle12", "hidden_state", 1
    else:
        raise BadInput("missing aux_hidden_state (SpecForge) or hidden_state (EAGLE-1/2)", path=p,
                       field="aux_hidden_state")
    aux = d[key]
    if not isinstance(aux, torch.Tensor) or not aux.is_floating_point():
        raise BadInput("expected a floating-point tensor", path=p, field=key)
    plain_float_states(aux.dtype, p, key)
    if aux.dim() == 3 and aux.shape[0] == 1:
        aux = aux[0]
    if aux.dim() != 2:
        raise BadInput(f"expected [1, L, W] or [L, W], got {tuple(d[key].shape)}", path=p, field=key)
    if aux.shape[0] != ids.shape[0]:
        raise BadInput(f"{aux.shape[0]} rows but {ids.shape[0]} input_ids", path=p, field=key)
    if lm is not None and lm.shape[0] != ids.shape[0]:
        raise BadInput(f"{lm.shape[0]} entries but {ids.shape[0]} input_ids", path=p, field="loss_mask")
    if layout == "eagle12":
        H, C = aux.shape[1], 1
        if hidden_size and aux.shape[1] != hidden_size:
            raise BadInput(f"width {aux.shape[1]} differs from the target hidden size {hidden_size}", path=p, field=key)
    else:
        H, C = _chunks(int(aux.shape[1]), hidden_size, default_chunks, p, key)
    L = _strip_trailing_pad(ids, lm)
    rows = aux[:L]
    stem = sample_key(p)
    final = None
    if layout == "specforge" and isinstance(d.get("hidden_state"), torch.Tensor):
        fh = d["hidden_state"]
        fh = fh[0] if fh.dim() == 3 and fh.shape[0] == 1 else fh
        if fh.dim() != 2 or fh.shape[0] != ids.shape[0] or not fh.is_floating_point():
            raise BadInput(f"expected [1, {ids.shape[0]}, H] floats (the target's post-norm final hidden state), got "
                           f"{tuple(d['hidden_state'].shape)} {d['hidden_state'].dtype}", path=p, field="hidden_state")
        plain_float_states(fh.dtype, p, "hidden_state")
        final = fh[:L]
    elif layout == "eagle12":
        final = rows                                    # EAGLE-1/2's one state is the post-norm top layer
    return Sample(key=stem, rows=L, width=int(aux.shape[1]), loader=(lambda t=rows: t), input_ids=ids[:L].copy(),
                  sample_id=stem, dtype=str(aux.dtype).replace("torch.", ""),
                  meta={"layout": layout, "hidden_size": H, "num_chunks": C, "path": str(p),
                        "loss_mask": None if lm is None else lm[:L], "padded_len": int(ids.shape[0]),
                        "final_hidden": final})


def read_speculators_sample(path: str | Path, *, hidden_size: Optional[int] = None) -> Sample:
    """Read one speculators ``hs_*.safetensors`` sample; rows are ``hidden_states[:, :-1].flatten(1)``.

    Raises:
        BadInput: corrupt/empty file, missing ``token_ids``/``hidden_states``, wrong ranks, fewer than 2 slots,
            or a slot width different from ``hidden_size``.
    """

    p = Path(path)
    if regular_file(p, "speculators hidden-state file").stat().st_size == 0:
        raise BadInput("missing or empty file (expected a speculators hs_*.safetensors)", path=p)
    try:
        with safe_open(str(p), framework="pt") as sf:
            keys = set(sf.keys())
            for k in ("token_ids", "hidden_states"):
                if k not in keys:
                    raise BadInput("missing tensor (speculators hidden-state files hold token_ids and hidden_states)",
                                   path=p, field=k)
            ids_t = sf.get_tensor("token_ids")
            hs = sf.get_tensor("hidden_states")
    except BadInput:
        raise
    except Exception as e:
        raise BadInput(f"not a readable safetensors file ({' '.join(str(e).split())[:160]})", path=p) from None
    ids = _ids(ids_t, p, "token_ids")
    if not hs.is_floating_point():
        raise BadInput(f"expected a floating-point tensor, got {hs.dtype}", path=p, field="hidden_states")
    plain_float_states(hs.dtype, p, "hidden_states")
    if hs.dim() != 3 or hs.shape[0] != ids.shape[0] or hs.shape[1] < 2 or hs.shape[2] < 1:
        raise BadInput(f"expected [L={ids.shape[0]}, slots>=2, H], got {tuple(hs.shape)}", path=p, field="hidden_states")
    H = int(hs.shape[2])
    if hidden_size and H != hidden_size:
        raise BadInput(f"slot width {H} differs from the target hidden size {hidden_size}", path=p, field="hidden_states")
    C = int(hs.shape[1]) - 1
    rows = hs[:, :-1].reshape(hs.shape[0], C * H)
    stem = sample_key(p)
    return Sample(key=stem, rows=int(ids.shape[0]), width=C * H, loader=(lambda t=rows: t), input_ids=ids,
                  sample_id=stem, dtype=str(hs.dtype).replace("torch.", ""),
                  meta={"layout": "speculators", "hidden_size": H, "num_chunks": C, "path": str(p),
                        "slots": int(hs.shape[1])})


def dump_loss_mask(s: Sample) -> Optional[np.ndarray]:
    """The loss mask of a project (e3f) dump sample: int64 ``[rows]``, 1 where the row's position
    (``first_position + t``) is at or past ``num_prompt_tokens`` (the continuation, as a trainer masks the response
    in), 0 on the prompt; None when ``num_prompt_tokens`` is not recorded (nothing says where the continuation
    starts). The stand-in for withheld training data (:func:`helpers.draft.plan_id.write_plan_dump`) records it."""
    if s.num_prompt_tokens is None:
        return None
    pos = int(s.first_position) + np.arange(int(s.rows))
    return (pos >= int(s.num_prompt_tokens)).astype(np.int64)


class TrainingData:
    """A training data set, streamed: :meth:`__iter__` yields one :class:`Sample` at a time (its tensor loaded
    on ``Sample.load()``; nothing else is kept).

    Attributes:
        path: what was passed.
        layout: ``ckpt`` (SpecForge / EAGLE-1/2), ``speculators`` or ``e3f-dump``.
        files: the sample files (one folder for a dump).
        first: the first sample (read eagerly to learn width, dtype, layout and H).
    """

    def __init__(self, path: str | Path, *, hidden_size: Optional[int] = None, max_samples: Optional[int] = None):
        self.path = Path(path)
        self.hidden_size_hint = hidden_size
        self.max_samples = max_samples
        #: set by iteration: True when ``max_samples`` stopped it before the last sample
        self.truncated = False
        self.layout, self.files = list_training_files(self.path)
        self._dump: Optional[SampleSource] = None
        if self.layout == "e3f-dump":
            self._dump = read_dump(self.files[0])
            if self._dump.kind not in ("training", "served", "reference"):
                raise BadInput(f"dump kind {self._dump.kind!r} cannot be training data", path=self.files[0])
        self.first = next(iter(self))

    @property
    def sample_layout(self) -> str:
        """``specforge`` | ``eagle12`` | ``speculators`` | ``e3f-dump``."""
        return self.first.meta.get("layout", self.layout)

    @property
    def hidden_size(self) -> int:
        return int(self.first.meta["hidden_size"])

    @property
    def num_chunks(self) -> int:
        return int(self.first.meta["num_chunks"])

    @property
    def width(self) -> int:
        return self.first.width

    @property
    def dtype(self) -> str:
        return self.first.dtype

    @property
    def layer_plan(self) -> Optional[dict]:
        return None if self._dump is None else self._dump.layer_plan

    def __iter__(self) -> Iterator[Sample]:
        n = 0
        if self._dump is not None:
            H = self.hidden_size_hint or self._dump.hidden_size
            for s in self._dump.samples:
                if self.max_samples is not None and n >= self.max_samples:
                    self.truncated = True
                    return
                if H is None:
                    raise BadInput("the training dump does not record hidden_size; pass the target config",
                                   path=self._dump.path, field="hidden_size")
                if s.width % H:
                    raise BadInput(f"width {s.width} is not a multiple of the hidden size {H}", path=self._dump.path,
                                   field=f"samples[{s.key}].width")
                s.meta.update({"layout": "e3f-dump", "hidden_size": H, "num_chunks": s.width // H})
                if s.meta.get("loss_mask") is None and self._dump.kind == "training":
                    s.meta["loss_mask"] = dump_loss_mask(s)     # a served / reference dump: none, as before
                if s.sample_id is None:
                    s.sample_id = s.key
                n += 1
                yield s
            return
        first_meta = None
        for k, f in enumerate(self.files):
            if self.max_samples is not None and n >= self.max_samples:
                self.truncated = True
                return
            if k + 1 < len(self.files) and (self.max_samples is None or n + 1 < self.max_samples):
                readahead(self.files[k + 1])     # the next file loads from disk while this one is compared
            s = (read_speculators_sample(f, hidden_size=self.hidden_size_hint) if self.layout == "speculators"
                 else read_ckpt_sample(f, hidden_size=self.hidden_size_hint))
            if first_meta is None:
                first_meta = (s.meta["layout"], s.width, s.dtype)
            elif (s.meta["layout"], s.width, s.dtype) != first_meta:
                raise BadInput(f"layout/width/dtype {(s.meta['layout'], s.width, s.dtype)} differs from the first "
                               f"file's {first_meta}", path=f)
            n += 1
            yield s


def recorded_layer_ids(path: str | Path) -> Optional[tuple[list[int], Path]]:
    """The aux layer ids a training data set records it was captured with, if it records them.

    SpecForge does not persist the ids of a run into the exported draft config when they came from the
    run YAML (``model.aux_hidden_state_layer_ids``, read by SpecForge
    ``specforge/algorithms/model_providers.py::resolve_eagle_capture_layers``), so the draft's
    ``config.json`` is not proof of what the draft saw. A data folder written by this project's
    ``env/models/make_draft_data.py`` (and any folder where an engineer drops the same file) carries a
    ``capture.json`` with ``layer_ids.specforge_out_i``: the ids in SpecForge's output-of-layer
    convention (id i = output of decoder layer i = HF ``hidden_states[i + 1]``).

    Args:
        path: the training data folder (or a file inside it); ``capture.json`` is looked for in the
            folder and its two parents.

    Returns:
        ``(ids, manifest_path)`` with ids in SpecForge's output-of-layer convention, or None when no
        manifest records them.

    Raises:
        BadInput: a ``capture.json`` exists but is not JSON or its ``layer_ids.specforge_out_i`` is not
            a list of ints.
    """

    got = data_manifest(path)
    if got is None:
        return None
    doc, m = got
    ids = (doc.get("layer_ids") or {}).get("specforge_out_i") if isinstance(doc.get("layer_ids"), dict) else None
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise BadInput(f"expected a list of ints, got {ids!r}", path=m, field="layer_ids.specforge_out_i")
    return list(ids), m
