"""Dumps of the aux hidden states a live SGLang server feeds its EAGLE-3 draft.

Three captures, each written as a project dump (``helpers.formats.dumps``; DESIGN.md) in a run folder:

* :func:`capture_served` - what the draft receives: ``/generate`` with ``return_hidden_states``
  and ``return_prompt_token_ids``. On an EAGLE-3 server the returned rows are the concatenated aux
  hidden states (``sglang/srt/layers/logits_processor.py::_get_hidden_states_to_store``:
  ``torch.cat(aux_hidden_states, -1)``, the same tensor the draft consumes). The prompt block
  ``meta_info.hidden_states[0]`` covers the whole prompt only when nothing of it is cached, so the
  radix cache is flushed before every request (``/flush_cache``) unless ``flush=False``; the dump
  records ``first_position`` when the block is short anyway. Feeding the *full* training sequence
  (prompt + response ids) with ``max_new_tokens=1`` gives one served row per training row.
* :func:`capture_reference` - every layer's residual stream for the same tokens, from a second
  SGLang server started with ``--enable-return-aux-hidden-states --speculative-algorithm EAGLE3
  --return-aux-hidden-state-layer-ids 0 1 ... n-2`` (:func:`reference_server_args`; SGLang adds +1
  and captures in(i+1) = out(i), ascending; ``out(n-1)`` and the embedding are unreachable there,
  ``sglang/srt/models/llama.py``), or from HF transformers (:func:`capture_reference_hf`:
  ``hidden_states[k]`` = out(k-1), k = 0 the embedding) when the target's weights are at hand.
* :func:`per_rank_dumps` - one dump per TP rank from the files the ``helpers.hooks`` capture hook
  wrote on the server (real per-rank tensors: the aux the draft received on that rank, the
  all-reduced and the rank-local embedding, layer outputs, per-rank partial sums).
* :func:`capture_every_layer` - layer identity from the server itself: the embedding and every decoder
  layer's residual stream ``out(0)`` .. ``out(n-1)`` for the training samples' tokens, recorded by the
  ``helpers.hooks`` capture hook on each TP rank of the running server (started with
  ``--forward-hooks`` from :func:`every_layer_hook_specs` and, on GPUs, ``--disable-cuda-graph``), written
  as a reference dump (``layer_plan.tensors = ["embedding", "out(0)", ...]``) for ``diagnose
  --reference``. A target too large to load for an HF reference still gets every served and training
  chunk identified by layer.
"""
from __future__ import annotations

import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import torch
from safetensors.torch import load_file
from tqdm.auto import tqdm

from .layers.ids import layer_index
from .errors import BadInput, SGLangError, one_line, printable
from .acceptance.prompts import Prompt
from .acceptance.requests import record as request_record
from .formats.dumps import Sample, samples_from_generate, write_dump
from .formats.configs import read_target_config
from .formats.hf_target import every_layer_states, load_hf_target
from .hooks import ARM_FILE, CaptureConfig, ModelFamily, every_layer_keys, hook_specs
from .trace_hooks import trace_hook_specs
from .runfiles import armed_file, loads_json
from .server.client import as_client
from .server.embedded import start
from .redaction import redact

UNREACHABLE_NOTE = ("SGLang's aux capture cannot reach the embedding (id -1) nor out(n-1) (capture "
                    "index n is past the layer loop): sglang/srt/models/llama.py")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def prompt_fields(p: Any, i: int) -> tuple[str, Optional[list[int]], Optional[str]]:
    """``(id, input_ids, text)`` of prompt ``i``: a :class:`helpers.acceptance.prompts.Prompt`, a token-id sequence, a
    string, a dict with ``input_ids`` / ``text``, or a training :class:`helpers.formats.dumps.Sample` (ids as ints;
    the one not given is None)."""
    if isinstance(p, Sample):
        return str(p.sample_id or p.key), [int(t) for t in np.asarray(p.input_ids).tolist()], None
    if isinstance(p, str):
        return f"p{i:03d}", None, p
    if hasattr(p, "request") and hasattr(p, "id"):  # helpers.acceptance.prompts.Prompt
        ids = getattr(p, "input_ids", None)
        return str(p.id), (list(ids) if ids is not None else None), getattr(p, "text", None)
    if isinstance(p, dict):
        ids = p.get("input_ids")
        return str(p.get("id", p.get("sample_id", f"p{i:03d}"))), \
            (None if ids is None else [int(t) for t in ids]), p.get("text")
    return f"p{i:03d}", [int(t) for t in p], None


def safe_key(s: str) -> str:
    """A dump sample key from a prompt or sample id: characters other than ``A-Za-z0-9_.:#=-`` become ``-``, at most
    80 characters (``"sample"`` for an empty result)."""
    return re.sub(r"[^A-Za-z0-9_.:#=-]+", "-", s)[:80] or "sample"


def capture_served(client_or_url: Any, prompts: Sequence[Any], out_dir: str | os.PathLike, *,
                   name: str = "served", max_new_tokens: int = 1, flush: bool = True,
                   kind: str = "served", layer_plan: Optional[dict] = None,
                   api_key: Optional[str] = None, progress: bool = True,
                   max_width: Optional[int] = None, records: Optional[list] = None,
                   sampling: Optional[dict] = None) -> Path:
    """Capture the aux hidden states fed to the draft for ``prompts``; write ``out_dir/name``.

    Args:
        client_or_url: :class:`helpers.server.client.SGLangClient`, a URL, or a launcher handle.
        prompts: token-id sequences (e.g. training samples: rows then align with the training
            rows), strings, ``helpers.acceptance.prompts.Prompt`` objects, or ``helpers.formats.dumps.Sample``.
        out_dir: parent folder (a run folder's ``dumps/``); ``out_dir/name`` must not exist.
        max_new_tokens: tokens to generate per prompt; each adds one decode row (the row of the
            position that produced it), except the last.
        flush: POST ``/flush_cache`` before each request so the prompt block is complete.
        kind: manifest kind (``served`` or ``reference``).
        layer_plan: what the chunks are, e.g. ``{"tensors": ["out(1)", ...]}`` (reference dumps).
        api_key: bearer token (default ``$SGLANG_API_KEY``); never written anywhere.
        progress: show a tqdm bar.
        max_width: the widest row accepted (e.g. 16 x the target's hidden size); a wider answer stops the capture
            before anything is written.
        records: when a list, one live per-request record per prompt is appended to it (the columns of
            :func:`helpers.acceptance.requests.run_requests`: ``spec_verify_ct``, completion tokens, accepted drafts,
            histogram of the same request), so the served aux states and the accept counters come from one answer.
        sampling: SGLang ``sampling_params`` laid over the default ``{"temperature": 0.0, "ignore_eos": True}``
            (greedy, full length), e.g. ``{"temperature": 1.0, "sampling_seed": 7}``; the rows are then the served
            states of the *sampled* continuation (the manifest's ``source.sampling`` says which).

    Returns: the dump folder. Row t of each sample belongs to ``input_ids[t]``.

    Raises:
        helpers.server.HiddenStatesDisabled: the server lacks ``--enable-return-hidden-states``
            (the message names the flag).
        helpers.errors.SGLangError: a response without usable hidden states, or rows wider than ``max_width``
            (a server fault: exit 1).
        FileExistsError: the dump folder exists.
    """


    client = as_client(client_or_url, api_key=api_key)
    info = client.server_info()
    snapshot = redact(info, client.secrets)
    samples: list[Sample] = []
    keys: set[str] = set()
    notes: list[str] = []
    for i, p in enumerate(tqdm(list(prompts), desc=f"capture {name}", unit="prompt",
                               disable=not progress)):
        pid, ids, text = prompt_fields(p, i)
        if flush:
            client.flush_cache()
        res = client.generate(input_ids=ids, text=text if ids is None else None,
                              max_new_tokens=max_new_tokens, return_hidden_states=True,
                              return_prompt_token_ids=True,
                              sampling_params=sampling_params(sampling, i))
        if records is not None:
            records.append(request_record(len(records), Prompt(id=pid, input_ids=tuple(ids) if ids is not None
                                                               else None, text=text if ids is None else None,
                                                               kind="capture"), res, None))
        raw = res.model_dump(exclude={"latency_s"})
        try:
            got = samples_from_generate(raw, source=f"{name}:{pid}")
        except BadInput as exc:
            raise SGLangError(f"POST {client._shown_url}/generate ({pid}): {one_line(exc)}",
                              endpoint="/generate") from None
        for s in got:
            w = int(s.width) if getattr(s, "width", None) is not None else None
            if max_width is not None and w is not None and w > max_width:
                raise SGLangError(f"POST {client._shown_url}/generate ({pid}): hidden-state rows are {w} wide, over "
                                  f"the limit of {max_width} (16 x the target's hidden size); nothing was written",
                                  endpoint="/generate")
        for s in got:
            key = safe_key(pid)
            while key in keys:
                key += "+"
            keys.add(key)
            s.key, s.sample_id = key, pid
            if s.first_position:
                notes.append(f"{pid}: prompt block starts at position {s.first_position} "
                             "(cached or chunked prefix)")
            samples.append(s)
    extra = {"kind": kind, "source": {"type": "sglang_generate", "url": client._shown_url,
                                      "flush_cache": flush, "max_new_tokens": max_new_tokens,
                                      "captured": _now(), "notes": notes,
                                      **({} if sampling is None else {"sampling": sampling_params(sampling, None)})},
             "server": snapshot, "sglang_version": info.get("version"),
             "tp_size": info.get("tp_size"), "layer_plan": layer_plan}
    return write_dump(Path(out_dir) / name, samples, extra)


def sampling_params(sampling: Optional[dict], i: Optional[int]) -> dict:
    """The ``sampling_params`` of capture request ``i``: greedy full-length by default, ``sampling`` laid over it; a
    ``sampling_seed`` of ``sampling`` becomes ``seed + i`` (one seed per prompt, the same on every run; ``i`` None:
    the base seed, as the manifest records it)."""
    sp = {"temperature": 0.0, "ignore_eos": True, **dict(sampling or {})}
    if i is not None and sp.get("sampling_seed") is not None:
        sp["sampling_seed"] = int(sp["sampling_seed"]) + int(i)
    return sp


def reference_server_args(num_layers: int, layer_ids: Optional[Sequence[int]] = None) -> tuple[list[str], list[str]]:
    """Flags for a reference-capture server and the physical tensor of each returned chunk.

    ``layer_ids`` use SGLang's EAGLE3 convention (id i -> capture index i+1 -> out(i)); default
    ``0 .. n-2`` (every reachable layer). Returns ``(extra_args, tensors)`` where ``tensors`` is
    ascending (``["out(0)", ..., "out(n-2)"]``): SGLang concatenates in layer-loop order.
    Mirrors ``sglang/srt/arg_groups/validation_hook.py::handle_aux_hidden_state_capture`` (ids
    must be distinct, non-negative, below n) and ``spec_aux_hidden_state.py``.
    """
    ids = sorted(set(range(num_layers - 1) if layer_ids is None else layer_ids))
    bad = [i for i in ids if i < 0 or i >= num_layers - 1]
    if bad:
        raise ValueError(f"layer ids {bad} cannot be captured by SGLang on a {num_layers}-layer "
                         f"target ({UNREACHABLE_NOTE})")
    args = ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
            "--return-aux-hidden-state-layer-ids", *[str(i) for i in ids]]
    return args, [f"out({i})" for i in ids]


def start_reference_server(target: str | os.PathLike, *, tp: int = 1,
                           layer_ids: Optional[Sequence[int]] = None, **kwargs: Any):
    """Start the embedded reference server in aux-capture mode (no draft); returns
    ``(handle, tensors)``. See :func:`reference_server_args`."""

    n = read_target_config(target).num_hidden_layers
    args, tensors = reference_server_args(n, layer_ids)
    handle = start(target, None, tp=tp, extra_args=args + list(kwargs.pop("extra_args", [])),
                   **kwargs)
    return handle, tensors


def capture_reference(client_or_url: Any, prompts: Sequence[Any], out_dir: str | os.PathLike,
                      tensors: Sequence[str], *, name: str = "reference", **kwargs: Any) -> Path:
    """:func:`capture_served` on a reference-capture server; the dump's ``layer_plan.tensors``
    names every H-wide chunk (``tensors`` from :func:`reference_server_args`)."""
    plan = {"tensors": list(tensors), "note": UNREACHABLE_NOTE}
    return capture_served(client_or_url, prompts, out_dir, name=name, kind="reference",
                          layer_plan=plan, **kwargs)


def capture_reference_hf(target: str | os.PathLike, prompts: Sequence[Any],
                         out_dir: str | os.PathLike, *, name: str = "reference-hf",
                         dtype: torch.dtype = torch.float32, progress: bool = True) -> Path:
    """Every layer of the target, from HF transformers: chunks ``embedding, out(0) .. out(n-1)``.

    (:func:`helpers.formats.hf_target.every_layer_states`: out(n-1) is the input of ``model.norm``, not HF's
    post-norm last entry).
    """
    model = load_hf_target(target, dtype)
    n = model.config.num_hidden_layers
    samples = []
    for i, p in enumerate(tqdm(list(prompts), desc=f"capture {name}", unit="prompt", disable=not progress)):
        pid, ids, text = prompt_fields(p, i)
        if ids is None:
            raise ValueError(f"prompt {pid}: HF reference capture needs token ids")
        samples.append({"key": safe_key(pid), "sample_id": pid, "input_ids": ids,
                        "hidden": torch.cat(every_layer_states(model, ids), dim=-1).to(torch.float32)})
    plan = {"tensors": ["embedding"] + [f"out({i})" for i in range(n)],
            "note": "HF transformers output_hidden_states; out(n-1) from the input of model.norm"}
    return write_dump(Path(out_dir) / name, samples,
                      {"kind": "reference", "source": {"type": "hf", "target": str(target),
                                                       "captured": _now()},
                       "layer_plan": plan, "hidden_size": model.config.hidden_size})


def every_layer_hook_specs(capture_dir: str | os.PathLike, num_layers: int,
                           family: Optional[ModelFamily] = None) -> list[dict]:
    """The ``--forward-hooks`` specs that make a server record every layer (armed by
    :func:`capture_every_layer` only while it captures). Module names of the target's ``family``
    (:func:`helpers.hooks.model_family`; default Llama: ``model.embed_tokens``, ``model.layers.{i}.input_layernorm``,
    ``model.norm``, the same on SGLang 0.5.23's DeepSeek-V2/V3; ``language_model.`` in front for Kimi-K2.5); pass them to
    ``helpers.server.embedded.start(forward_hooks=...)``, ``python -m helpers server start --capture-layers DIR`` or, on a
    GPU server, ``--forward-hooks '<json>' --disable-cuda-graph`` (``env/gpu/launch_tp8.sh`` with ``LAYERS_DIR``)."""

    specs = hook_specs(capture=CaptureConfig(out_dir=os.fspath(capture_dir), keys=every_layer_keys(num_layers),
                                             armed_by_file=True), num_layers=num_layers, family=family)
    for s in specs:
        if s["name"] == "e3f-capture":     # distinct from a per-rank embedding capture on the same server
            s["name"] = "e3f-capture-layers"
    return specs


RANK_CAPTURE_KEYS = ("embedding", "embedding_local")
"""Per-rank stash keys the hypothesis checks read (with ``aux``, which every capture records): the all-reduced and
the rank-local (pre-all-reduce) embedding (helpers.investigation.checks: tp_sharding, embedding_all_reduce)."""


def server_hook_specs(num_layers: int, *, faults: Sequence[Any] = (), rank_capture_dir: Optional[str | os.PathLike] = None,
                      layers_dir: Optional[str | os.PathLike] = None,
                      family: Optional[ModelFamily] = None, trace_dir: Optional[str | os.PathLike] = None,
                      draft_dir: Optional[str | os.PathLike] = None) -> Optional[list[dict]]:
    """The one ``--forward-hooks`` list for a server of this tool: injected ``faults`` (helpers.faults.Fault or
    dicts), a per-rank capture into ``rank_capture_dir`` (armed by file, keys :data:`RANK_CAPTURE_KEYS` + aux) and an
    every-layer reference capture into ``layers_dir`` (:func:`every_layer_hook_specs`), on the module names of the
    target's ``family`` (:func:`helpers.hooks.model_family`, default Llama), and the draft step trace into
    ``trace_dir`` (:func:`helpers.trace_hooks.trace_hook_specs`, the hot-token map read from ``draft_dir``). Stash
    specs shared by several parts appear once. Returns None when nothing is asked for.

    The two capture folders are what ``investigate`` finds in ``/server_info`` ``forward_hooks`` (hook names
    ``e3f-capture`` and ``e3f-capture-layers``)."""
    specs: list[dict] = []
    if faults or rank_capture_dir is not None:
        cap = None if rank_capture_dir is None else CaptureConfig(
            out_dir=os.fspath(Path(rank_capture_dir).resolve()), keys=list(RANK_CAPTURE_KEYS), armed_by_file=True)
        specs += hook_specs(list(faults), cap, num_layers=num_layers, family=family)
    if layers_dir is not None:
        specs += every_layer_hook_specs(Path(layers_dir).resolve(), num_layers, family)
    if trace_dir is not None:
        specs += trace_hook_specs(trace_dir, draft_dir)
    out, seen = [], set()
    for spec in specs:
        key = json.dumps(spec, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        out.append(spec)
    return out or None


def capture_every_layer(client_or_url: Any, prompts: Sequence[Any], capture_dir: str | os.PathLike,
                        out_dir: str | os.PathLike, *, num_layers: Optional[int] = None, name: str = "reference-server",
                        rank: int = 0, api_key: Optional[str] = None, progress: bool = True) -> Path:
    """Record every layer of the running server for ``prompts`` and write a reference dump ``out_dir/name``.

    Args:
        client_or_url: the server (started with :func:`every_layer_hook_specs` hooks writing to ``capture_dir``).
        prompts: training samples / token-id sequences (each sent once, ``max_new_tokens=1``, cache flushed).
        capture_dir: the hooks' ``out_dir`` (must be readable here: the embedded server, or a shared folder).
        out_dir: parent folder of the dump (``out_dir/name`` must not exist).
        num_layers: the target's ``num_hidden_layers`` (default: the ``out(L)`` keys the hooks recorded).
        rank: the TP rank whose files become the reference (the stream is replicated on every rank after the
            all-reduce; :func:`per_rank_dumps` gives the others).

    Returns: the reference dump folder (chunks ``embedding, out(0) .. out(n-1)``, the dtype the server
    computed in).

    Raises:
        helpers.errors.BadInput: the server wrote no layer files (hooks missing, or ``capture_dir`` is not the
            folder the server writes to); the message says which flags the server needs.
    """


    cap = Path(capture_dir)
    client = as_client(client_or_url, api_key=api_key)
    info = client.server_info()
    before = {r: len(recs) for r, recs in _rank_index(cap).items()}
    cap.mkdir(parents=True, exist_ok=True)
    sent: list[tuple[str, list[int]]] = []
    with armed_file(cap / ARM_FILE, f"armed by helpers.capture.capture_every_layer (pid {os.getpid()})\n",
                    what="every-layer capture arm file"):
        for i, p in enumerate(tqdm(list(prompts), desc=f"capture {name}", unit="prompt", disable=not progress)):
            pid, ids, text = prompt_fields(p, i)
            if ids is None:
                raise BadInput(f"prompt {pid}: the every-layer capture needs token ids", field="prompts")
            client.flush_cache()
            client.generate(input_ids=ids, max_new_tokens=1, sampling_params={"temperature": 0.0, "ignore_eos": True})
            sent.append((pid, ids))
    index = _rank_index(cap)
    if num_layers is None:

        layers = {L for r in index.get(rank, [])[before.get(rank, 0):] for k in r.get("keys", [])
                  if (L := layer_index(k)) is not None and L >= 0}
        num_layers = max(layers) + 1 if layers else 0
    need = ["embedding"] + [f"out({L})" for L in range(num_layers)]
    recs = [r for r in index.get(rank, [])[before.get(rank, 0):]
            if r.get("mode") == "EXTEND" and all(k in r.get("keys", []) for k in need)]
    if not recs or num_layers == 0:
        raise BadInput(f"the server wrote no every-layer files for rank {rank} under {cap}: start it with "
                       "--forward-hooks from helpers.capture.every_layer_hook_specs(DIR, n) writing to this folder "
                       "(python -m helpers server start --capture-layers DIR; on GPUs also --disable-cuda-graph)",
                       path=cap)

    by_ids: dict[tuple, dict] = {}
    for r in recs:
        t = load_file(str(cap / f"rank{rank}" / r["file"]))
        by_ids.setdefault(tuple(int(x) for x in t["input_ids"].tolist()), t)
    samples = []
    missing = []
    for pid, ids in sent:
        t = by_ids.get(tuple(ids))
        if t is None:
            missing.append(pid)
            continue
        samples.append({"key": safe_key(pid), "sample_id": pid, "input_ids": ids,
                        "hidden": torch.cat([t[k] for k in need], dim=-1)})
    if not samples:
        raise BadInput(f"no recorded forward carries the prompts' token ids (rank {rank}, {len(recs)} forwards "
                       f"recorded): was the prefix cache flushed, and is {cap} this server's hook folder?", path=cap)
    H = int(samples[0]["hidden"].shape[1]) // len(need)
    plan = {"tensors": need, "note": "the server's own residual stream per layer, recorded by helpers.hooks on "
                                     f"TP rank {rank} (model.embed_tokens; model.layers.{{L+1}}.input_layernorm / "
                                     "model.norm residual output = out(L))"}
    return write_dump(Path(out_dir) / name, samples,
                      {"kind": "reference", "source": {"type": "server_forward_hooks", "capture_dir": str(cap),
                                                       "url": client._shown_url, "tp_rank": rank,
                                                       "captured": _now(), "prompts_missing": missing},
                       "server": redact(info, client.secrets), "sglang_version": info.get("version"),
                       "tp_rank": rank, "tp_size": info.get("tp_size"), "layer_plan": plan, "hidden_size": H})


def _rank_index(capture_dir: Path) -> dict[int, list[dict]]:
    try:
        return read_rank_capture(capture_dir)
    except FileNotFoundError:
        return {}


def read_rank_capture(capture_dir: str | os.PathLike) -> dict[int, list[dict]]:
    """Index of a ``helpers.hooks`` capture folder: ``{rank: [index.jsonl records]}``. Every record's ``file`` is a
    file name inside its own ``rank<r>/`` folder (checked here, so ``capture_dir / f"rank{r}" / rec["file"]`` never
    opens a file elsewhere: the index is written by the server's processes).

    Raises:
        SGLangError: a record that is not an object, or whose ``file`` is not a plain file name in its rank folder
            (``../x``, an absolute path, a link out of the folder), naming the index and the line.
        FileNotFoundError: no ``rank*/index.jsonl``."""
    out: dict[int, list[dict]] = {}
    for d in sorted(Path(capture_dir).glob("rank*")):
        idx = d / "index.jsonl"
        if idx.exists() and d.name[4:].isdigit():
            lines = [(n, line) for n, line in enumerate(idx.read_text().splitlines(), 1) if line.strip()]
            recs = [_rank_record(d, idx, n, loads_json(line)) for n, line in lines]
            out[int(d.name[4:])] = recs
    if not out:
        raise FileNotFoundError(f"{capture_dir}: no rank*/index.jsonl (was the server started "
                                "with helpers.hooks capture specs, and did a request run?)")
    return out


def _rank_record(rank_dir: Path, idx: Path, line: int, rec: Any) -> dict:
    """``rec`` (line ``line`` of ``idx``) when it is an object whose ``file`` names a file inside ``rank_dir``."""
    name = rec.get("file") if isinstance(rec, dict) else None
    inside = (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
              and "\0" not in name and (rank_dir / name).resolve().parent == rank_dir.resolve())
    if not inside:
        raise SGLangError(f"{idx}: line {line}: field file: {printable(repr(name))[:240]} is not a file name inside "
                          f"{rank_dir} (a capture record names its tensor file in its own rank folder)")
    return rec


def per_rank_dumps(capture_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                   key: str = "aux", modes: Iterable[str] = ("EXTEND",), name: str = "rank",
                   hidden_size: Optional[int] = None) -> list[Path]:
    """One dump per TP rank of stash ``key`` (``aux`` = what the draft received on that rank,
    ``embedding``, ``embedding_local``, ``out(L)``, ``mlp_partial(L)``, ...), keeping forwards
    whose mode is in ``modes`` (prefill = ``EXTEND``). Samples are keyed ``f{forward}``."""

    index = read_rank_capture(capture_dir)
    paths = []
    for rank, recs in sorted(index.items()):
        samples = []
        tp = None
        for rec in recs:
            if rec.get("mode") not in modes or key not in rec.get("keys", []):
                continue
            t = load_file(str(Path(capture_dir) / f"rank{rank}" / rec["file"]))
            tp = rec.get("tp_size")
            samples.append({"key": f"f{rec['forward']:06d}", "sample_id": f"f{rec['forward']:06d}",
                            "input_ids": t["input_ids"].to(torch.int64),
                            "hidden": t[key].to(torch.float32)})
        if not samples:
            raise ValueError(f"{capture_dir}/rank{rank}: no {list(modes)} forward recorded '{key}'")
        paths.append(write_dump(Path(out_dir) / f"{name}{rank}-{key.replace('(', '').replace(')', '')}",
                                samples, {"kind": "per_rank", "tp_rank": rank, "tp_size": tp,
                                          "module": key, "hidden_size": hidden_size,
                                          "source": {"type": "forward_hooks",
                                                     "capture_dir": str(capture_dir)}}))
    return paths
