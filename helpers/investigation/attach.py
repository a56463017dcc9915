"""Attach to a running server: what it runs, read from its client's ``server_info`` (any engine's
:class:`helpers.server.client.ServerClient`: SGLang's ``/server_info``, vLLM's worker extension or dev-mode config, in
one vocabulary) and the folders this machine sees (the first step of :func:`helpers.investigation.live.investigate`;
:func:`attach` is the one place that reads a server's own account of itself for the investigation)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import psutil

from ..acceptance.measure import server_snapshot
from ..diagnosis.detectors import finding
from ..draft.mtp_checks import MTP_ALGORITHMS, describe_head
from ..errors import BadInput
from ..formats.configs import read_config_json, read_target_config
from ..engines.sglang import UNVERIFIED_CAPTURE_PATHS, capture_caveats  # noqa: F401  (re-exported)
from ..layers.mtp import DRAFT_CONFIG_FALLBACK, mtp_head
from ..server.client import ServerClient
from ..server.registry import lookup
from ..runfiles import FINGERPRINT_BYTES, safetensors_fingerprint  # noqa: F401  (re-exported)
from ..server.restart import LAYERS_HOOK, relaunch_argv

HOOK_FACTORY_PREFIX = "helpers.hooks:"
#: helpers.trace_hooks.TRACE_FACTORY, spelled here so that attaching does not import torch (tests/unit check they agree)
TRACE_FACTORY = "helpers.trace_hooks:draft_trace_factory"


@dataclass
class Attachment:
    """What the server runs, read from ``/server_info`` (and the folders this machine sees).

    Attributes:
        url / version / tp / algorithm / spec: the server's URL, SGLang version, TP size, speculative algorithm and
            ``{num_steps, topk, num_draft_tokens}``.
        served_draft / served_target: the folders the server was started with (paths on the server's machine).
        draft_dir / target_dir: the folders used here, with ``draft_source`` / ``target_source`` saying which
            (``server`` or the given ``--draft`` / ``--target``).
        rank_capture_dir / layers_dir: this tool's per-rank and every-layer capture folders (from the server's
            ``forward_hooks``), None when not installed.
        other_hooks: forward hooks that are not capture hooks (``name``, ``target_modules``): anything they do to the
            residual stream is invisible to the config.
        restart: how the server can be restarted with a fix (``{"kind": "embedded", ...registry entry}`` or
            ``{"kind": "command", "argv": [...]}``), or None.
        findings: attach findings (the given draft differs from the served one).
        info: the redacted ``/server_info``.
        caveats: capture paths this server runs that the CPU reference could not verify (:func:`capture_caveats`).
        draft_head: when the draft is an MTP / NextN head (the target's extra layer or a separate NextN checkpoint):
            its family, class, source and the effective spec config
            (:func:`helpers.draft.mtp_checks.describe_head`), else None.
    """

    url: str
    version: Optional[str]
    tp: int
    algorithm: Optional[str]
    spec: dict
    served_draft: Optional[str]
    served_target: Optional[str]
    draft_dir: Optional[Path]
    draft_source: str
    target_dir: Path
    target_source: str
    rank_capture_dir: Optional[Path] = None
    layers_dir: Optional[Path] = None
    other_hooks: list = field(default_factory=list)
    restart: Optional[dict] = None
    findings: list = field(default_factory=list)
    info: dict = field(default_factory=dict)
    caveats: list = field(default_factory=list)
    draft_head: Optional[dict] = None

    def to_json(self) -> dict:
        return {"url": self.url, "engine": self.info.get("engine", "sglang"), "version": self.version, "tp": self.tp, "algorithm": self.algorithm,
                "spec": self.spec, "served_draft": self.served_draft, "served_target": self.served_target,
                "draft_dir": None if self.draft_dir is None else str(self.draft_dir), "draft_source": self.draft_source,
                "target_dir": str(self.target_dir), "target_source": self.target_source,
                "rank_capture_dir": None if self.rank_capture_dir is None else str(self.rank_capture_dir),
                "layers_dir": None if self.layers_dir is None else str(self.layers_dir),
                "other_hooks": self.other_hooks,
                "restart": None if self.restart is None else {"kind": self.restart["kind"]},
                "findings": self.findings, "caveats": self.caveats, "draft_head": self.draft_head}


def capture_hooks(info: dict) -> tuple[Optional[Path], Optional[Path], list[dict]]:
    """``(per-rank capture folder, every-layer capture folder, other hooks)`` from ``/server_info``'s
    ``forward_hooks`` (SGLang 0.5.23 reports the ``--forward-hooks`` list there: ``sglang/srt/arg_groups/fields/
    observability.py`` ``forward_hooks``). Hook names and ``config`` values may be redacted by SGLang; the folder
    (``config.out_dir``) and the factory survive."""
    ranks = layers = None
    others = []
    for h in info.get("forward_hooks") or []:
        if not isinstance(h, dict):
            continue
        factory = str(h.get("hook_factory") or "")
        name = str(h.get("name") or "")
        out_dir = (h.get("config") or {}).get("out_dir") if isinstance(h.get("config"), dict) else None
        if factory == HOOK_FACTORY_PREFIX + "capture_factory" and out_dir:
            if name == LAYERS_HOOK:
                layers = Path(out_dir)
            else:
                ranks = Path(out_dir)
        elif factory in (HOOK_FACTORY_PREFIX + "stash_factory", TRACE_FACTORY):
            continue                                     # read-only stashes and the draft step trace of this tool
        else:
            others.append({"name": name, "target_modules": h.get("target_modules"), "hook_factory": factory})
    return ranks, layers, others


def same_draft(a: Path, b: Path) -> Optional[dict]:
    """None when the two draft folders hold the same config and weight files (by size and name), else what differs
    (:func:`same_model`)."""
    return same_model(a, b, "draft config")


#: :func:`helpers.runfiles.safetensors_fingerprint` (moved there so a measurement's provenance can use it)
_fingerprint = safetensors_fingerprint


def same_model(a: Path, b: Path, what: str, *, ignore: tuple = (), fingerprint: bool = False) -> Optional[dict]:
    """None when the two model folders hold the same model, else what differs: ``config_keys`` (config.json keys
    whose values differ, ``ignore`` left out; ``eagle_config`` when that differs), ``weights`` (``*.safetensors``
    names and sizes) and, with ``fingerprint``, ``weight_bytes`` (files whose header and first MiB of tensor data
    differ: another checkpoint of the same architecture). Folders whose config cannot be read are not compared
    (None). Weights are compared only where both folders hold some (a config-only copy is no difference)."""
    try:
        ca, cb = ({k: v for k, v in read_config_json(p, what).items() if k not in ignore} for p in (a, b))
    except (OSError, ValueError):
        return None
    diff = {}
    if ca != cb:
        keys = sorted(k for k in set(ca) | set(cb) if ca.get(k) != cb.get(k))
        diff["config_keys"] = keys
        ea, eb = (c.get("eagle_config") or {} for c in (ca, cb))
        if ea != eb:
            diff["eagle_config"] = {"server": eb, "given": ea}
    wa = {p.name: p.stat().st_size for p in a.glob("*.safetensors")}
    wb = {p.name: p.stat().st_size for p in b.glob("*.safetensors")}
    if wa != wb and (not fingerprint or (wa and wb)):
        diff["weights"] = {"server": wb, "given": wa}
    elif fingerprint and wa and wa == wb:
        try:
            other = sorted(n for n in wa if _fingerprint(a / n) != _fingerprint(b / n))
        except OSError:
            other = []
        if other:
            diff["weight_bytes"] = other
    return diff or None


def attach(client: ServerClient, *, draft: Optional[str | Path] = None, target: Optional[str | Path] = None,
           relaunch: Optional[str] = None, caveats: Optional[Callable[..., list[str]]] = None) -> Attachment:
    """Read what the server runs (see :class:`Attachment`). ``caveats``: the server's engine's
    ``capture_caveats(info, architectures, model_type)`` (:meth:`helpers.engines.base.EngineAdapter.capture_caveats`;
    default SGLang's, :func:`capture_caveats`).

    Raises:
        ServerError: ``/server_info`` unreachable or not JSON.
        BadInput: neither the server's target folder nor ``target`` is readable here; a given folder lacks
            config.json.
    """
    info = client.server_info()
    served_draft = info.get("speculative_draft_model_path")
    served_target = info.get("model_path") or info.get("tokenizer_path")
    findings: list[dict] = []

    def readable(p: Any) -> Optional[Path]:
        return Path(p) if p and (Path(p) / "config.json").is_file() else None

    if target is not None:
        target_dir, target_source = Path(target), "--target"
        if not (target_dir / "config.json").is_file():
            raise BadInput("no config.json in the target folder", path=target_dir)
    elif readable(served_target):
        target_dir, target_source = Path(served_target), "server (model_path)"
    else:
        raise BadInput(f"the server's target folder {served_target!r} is not readable on this machine: pass --target "
                       "DIR (a folder with the target's config.json; weights optional)", path=served_target)
    given = Path(draft) if draft is not None else None
    if given is not None and not (given / "config.json").is_file():
        raise BadInput("no config.json in the draft folder", path=given)
    server_draft = readable(served_draft)
    if server_draft is not None:
        draft_dir, draft_source = server_draft, "server (speculative_draft_model_path)"
        if given is not None and given.resolve() != server_draft.resolve():
            diff = same_draft(given, server_draft)
            if diff is not None:
                findings.append(finding(
                    "served_draft_differs", None,
                    f"the server runs the draft in {server_draft}, which differs from --draft {given} "
                    f"({', '.join(sorted(diff))}); the investigation uses the server's",
                    served=str(server_draft), given=str(given), differences=diff,
                    source="/server_info speculative_draft_model_path"))
    elif given is not None:
        draft_dir, draft_source = given, "--draft (the server's draft folder is not readable here)"
    elif served_draft is None and str(info.get("speculative_algorithm") or "").upper() in MTP_ALGORITHMS \
            and mtp_head(read_config_json(target_dir / "config.json", "target config")) is not None:
        draft_dir = target_dir
        draft_source = f"the target's folder (no speculative_draft_model_path: {DRAFT_CONFIG_FALLBACK})"
    else:
        draft_dir, draft_source = None, "none"
    ranks, layers, others = capture_hooks(info)
    restart = None
    entry = lookup(client.url)
    if relaunch:
        restart = {"kind": "command", "argv": relaunch_argv(relaunch)}
    elif entry is not None:
        restart = {"kind": "embedded", **entry}
    spec = {"num_steps": info.get("speculative_num_steps"), "topk": info.get("speculative_eagle_topk"),
            "num_draft_tokens": info.get("speculative_num_draft_tokens")}
    tcfg = read_target_config(target_dir)
    head = describe_head(draft_dir, target_dir, info) if draft_dir is not None else None
    return Attachment(url=client.url, version=info.get("version"), tp=int(info.get("tp_size") or 1),
                      algorithm=info.get("speculative_algorithm"), spec=spec, served_draft=served_draft,
                      served_target=served_target, draft_dir=draft_dir, draft_source=draft_source,
                      target_dir=target_dir, target_source=target_source, rank_capture_dir=ranks, layers_dir=layers,
                      other_hooks=others, restart=restart, findings=findings, info=server_snapshot(info),
                      caveats=(caveats or capture_caveats)(info, tcfg.architectures, tcfg.model_type),
                      draft_head=head)


def require_draft(att: "Attachment") -> None:
    """The investigations that replay the served draft (``investigate``, ``investigate --check-draft``) need one: a
    server that runs no speculative decoding at all (``speculative_algorithm`` null, e.g. ``server start`` without
    ``--draft``) is named as such first, then a draft folder this machine cannot read.

    Raises:
        BadInput: one line naming what is missing (exit 2)."""
    if not att.algorithm:
        raise BadInput("the server runs no speculative decoding (its speculative_algorithm is null): there is no "
                       "draft to investigate; start it with one (`python -m helpers server start --draft DIR` or "
                       "--reference-draft; SGLang --speculative-algorithm EAGLE3 --speculative-draft-model-path DIR)",
                       field="speculative_algorithm")
    if att.draft_dir is None:
        raise BadInput("the server runs no draft this machine can read and no --draft was given "
                       "(speculative_draft_model_path)", path=att.served_draft, field="--draft")


def mtp_not_supported(head: dict, draft_dir: Path, target_dir: Path) -> str:
    """The one line an investigation of an MTP / NextN head stops with (exit 2, as for an unsupported input): what
    the attach found (``head``: :func:`helpers.draft.mtp_checks.describe_head`) and what is not built for such heads
    yet."""
    s = head["spec"]
    return (f"the server's draft is an MTP / NextN head, not an EAGLE-3 draft: {head['class']} "
            f"({head['family']} family, "
            f"{head['layers_field']} = {head['layers']}) from {head['source']}; algorithm "
            f"{s['algorithm_requested'] or '(not in the launch command)'} requested, {s['algorithm_as_run']} as run, "
            f"{s['num_steps']} steps, topk {s['topk']}, {s['num_draft_tokens']} draft tokens"
            + "".join(f" ({o['message']})" for o in s.get("overrides", []) if o["kind"] == "forced")
            + ". investigate does not "
            "support MTP heads yet here: `investigate` and --check-draft run a DeepSeek-V3-family NextN head "
            "(docs/mtp.md); the heads of other families are built for EAGLE-3 drafts only "
            f"(issue 37). Check its config now with: python -m helpers diagnose --draft-config {draft_dir} "
            f"--target-config {target_dir} --speculative-algorithm NEXTN")


#: targets HF was found to fit for in this process (resolved folder -> why): every later reference of the process
#: (the diagnosis's, then the live prompts' of the acceptance budget, once more when it grows) makes the same choice,
#: so one run never measures its wiring stage with a reference for some prompts and without for others
_FITS: dict[str, str] = {}


def hf_reference_fits(target_dir: Path, *, share: float = 0.5) -> tuple[bool, str]:
    """Whether HF transformers can load the target here (fp32 weights within ``share`` of the memory available now).

    The choice decides which evidence an investigation has (without a reference the wiring stage rests on the few
    training samples, and a run with one may clear what a run without one leaves undecided), so the reason says
    whether it is this machine's size (the same every run) or the memory free now (another run may choose
    otherwise). A target found to fit once fits for the rest of the process (:data:`_FITS`).

    Returns ``(fits, why)``; ``why`` names the sizes (or the missing weights)."""
    key = str(Path(target_dir).resolve())
    if key in _FITS:
        return True, _FITS[key]
    files = list(target_dir.glob("*.safetensors")) + list(target_dir.glob("*.bin"))
    if not files:
        return False, f"no weights in {target_dir} (config only)"
    size = sum(f.stat().st_size for f in files)
    dtype = read_target_config(target_dir).torch_dtype or "bfloat16"
    fp32 = size * (2 if "16" in str(dtype) else 1)
    mem = psutil.virtual_memory()
    if fp32 > share * mem.total:
        return False, (f"the target's weights need about {fp32 / 2**30:.1f} GiB in fp32, more than {share:.0%} of the "
                       f"{mem.total / 2**30:.1f} GiB this machine has")
    if fp32 > share * mem.available:
        return False, (f"the target's weights need about {fp32 / 2**30:.1f} GiB in fp32, more than {share:.0%} of the "
                       f"{mem.available / 2**30:.1f} GiB available now (of {mem.total / 2**30:.1f} GiB): with more "
                       "memory free, a run of the same investigation makes an HF reference and may decide what this "
                       "one leaves undecided")
    _FITS[key] = f"{fp32 / 2**30:.2f} GiB in fp32"
    return True, _FITS[key]
