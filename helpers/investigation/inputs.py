"""What a hypothesis check reads: the server under test with its training data and configs
(:class:`Investigation`), capturing what a check needs once (the served aux states, per-rank dumps, the reference)
and keeping it for the next check. The checks themselves are :mod:`helpers.investigation.checks`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch

from ..capture import capture_reference_hf, per_rank_dumps
from ..diagnosis.diagnose import diagnose
from ..diagnosis.plan_rules import PlanRules
from ..formats.configs import read_config_json
from ..formats.dumps import read_dump
from ..formats.training_data import TrainingData
from ..runfiles import safe_name
from ..engines.base import EngineAdapter
from ..engines.sglang import SGLangAdapter
from ..server.client import as_client


# --------------------------------------------------------------------------------------------
# The investigation context
# --------------------------------------------------------------------------------------------
class Investigation:
    """A server under test, with what the draft was trained on; captures on demand, cached.

    Args:
        run_dir: run folder; captures go to ``run_dir/dumps/<name>-*``.
        client_or_url: :class:`helpers.server.client.SGLangClient`, URL or launcher handle; None when
            the server did not start (config-only checks still run).
        training: draft training data (SpecForge folder, ...; helpers.formats.training_data).
        draft_dir: the draft folder the server was started with (config.json + weights).
        target_dir: the target folder (config.json; with weights, HF gives the reference).
        capture_dir: folder of the ``helpers.hooks`` per-rank capture of this server, or None.
        requested: the launch arguments asked for (for the override check), or None.
        name: prefix of this server's dumps (e.g. the fix name).
        num_samples: training samples to capture (full sequences, one served row per token).
        reference: ``"hf"`` (HF transformers on ``target_dir``), a dump path, or None.
        adapter: the server's engine adapter (:mod:`helpers.engines`; default SGLang's): its capture.
        rules: the engine's id rules for the diagnosis (default: the adapter's of the server's version).
    """

    def __init__(self, run_dir: str | os.PathLike, client_or_url: Any, *, training: str | os.PathLike,
                 draft_dir: str | os.PathLike, target_dir: str | os.PathLike,
                 capture_dir: Optional[str | os.PathLike] = None, requested: Any = None,
                 name: str = "server", num_samples: int = 4, reference: Any = "hf",
                 baseline: Optional[dict] = None, acceptance: Optional[dict] = None,
                 algorithm: Optional[str] = None, adapter: Optional[EngineAdapter] = None,
                 rules: Optional[PlanRules] = None):

        self.run_dir = Path(run_dir)
        self.adapter = adapter or SGLangAdapter()
        self.client = as_client(client_or_url) if client_or_url is not None else None
        self._rules = rules
        self.algorithm = algorithm
        self.training = Path(training)
        self.draft_dir = Path(draft_dir)
        self.target_dir = Path(target_dir)
        self.capture_dir = Path(capture_dir) if capture_dir else None
        self.requested = requested
        self.name = name
        self.num_samples = num_samples
        self.baseline = baseline      # summary of a target-only measurement, if any
        self.acceptance = acceptance  # summary of this server's measurement, if any
        self._training: Optional[list] = None
        self._served: Optional[Path] = None
        self._reference: Optional[tuple[Optional[Path]]] = None   # (path or None,) once resolved
        self._rank_dumps: dict[str, list[Path]] = {}
        self._diagnoses: dict[bool, Any] = {}
        self._spec: Any = None
        self.reference_spec = reference
        self.dumps_dir = self.run_dir / "dumps"
        self.dumps_dir.mkdir(parents=True, exist_ok=True)

    # -- inputs ------------------------------------------------------------------------------
    @property
    def reference_spec(self) -> Any:
        """The every-layer reference: ``"hf"``, a dump path or None; setting it drops the one resolved before."""
        return self._reference_spec

    @reference_spec.setter
    def reference_spec(self, value: Any) -> None:
        self._reference_spec = value
        self._reference = None

    @property
    def target_config(self) -> dict:
        return read_config_json(self.target_dir, "target config")

    @property
    def hidden_size(self) -> int:
        return int(self.target_config["hidden_size"])

    def server_info(self) -> dict:
        if self.client is None:
            raise RuntimeError("no live server for this step (it failed to start): only config-based "
                               "checks (static_wiring, vocab_map) can run")
        return self.client.server_info()

    @property
    def rules(self) -> PlanRules:
        """The serving engine's id rules (given, else the adapter's for the server's version, else SGLang's)."""
        if self._rules is None:
            version = None
            if self.client is not None:
                try:
                    version = self.server_info().get("version")
                except Exception:  # noqa: BLE001 - a server that died at startup: its configs' rules
                    version = None
            self._rules = self.adapter.rules(version)
        return self._rules

    def training_samples(self) -> list:
        """The first ``num_samples`` training samples (helpers.formats.dumps.Sample, pad stripped)."""
        if self._training is None:
            td = TrainingData(self.training, hidden_size=self.hidden_size,
                              max_samples=self.num_samples)
            self._training = list(td)[: self.num_samples]
        return self._training

    def _dump_name(self, what: str) -> str:

        return f"{safe_name(self.name)}-{what}"

    # -- captures ----------------------------------------------------------------------------
    def served_dump(self) -> Path:
        """What the draft receives for the training samples' tokens (one row per token)."""
        if self._served is None:
            path = self.dumps_dir / self._dump_name("served")
            if not (path / "manifest.json").exists():
                self.adapter.capture_served(self.client, self.training_samples(), self.dumps_dir, name=path.name,
                                            max_new_tokens=1, rank_dir=self.capture_dir,
                                            max_width=16 * self.hidden_size)
            self._served = path
        return self._served

    def reference_dump(self) -> Optional[Path]:
        """Every layer's hidden states for the same tokens (HF on the target), or None."""
        if self._reference is None:
            ref = self.reference_spec
            if ref is None:
                self._reference = (None,)
            elif ref == "hf":
                path = self.dumps_dir / "reference-hf"
                if not (path / "manifest.json").exists():
                    capture_reference_hf(self.target_dir, self.training_samples(), self.dumps_dir,
                                         name=path.name, progress=False)
                self._reference = (path,)
            else:
                self._reference = (Path(ref),)
        return self._reference[0]

    def rank_dumps(self, key: str) -> list[Path]:
        """Per-TP-rank dumps of stash ``key`` recorded while :meth:`served_dump` ran."""
        if key not in self._rank_dumps:
            if self.capture_dir is None:
                raise RuntimeError("no per-rank capture: start the server with helpers.hooks "
                                   "capture specs (Investigation(capture_dir=...))")

            self.served_dump()
            out = self.dumps_dir / self._dump_name(f"ranks-{key.replace('(', '').replace(')', '')}")
            if out.exists():
                paths = sorted(p for p in out.iterdir() if (p / "manifest.json").exists())
            else:
                paths = per_rank_dumps(self.capture_dir, out, key=key, hidden_size=self.hidden_size)
            self._rank_dumps[key] = paths
        return self._rank_dumps[key]

    def diagnosis(self, reference: bool = True):
        """helpers.diagnosis.diagnose on the served dump against the training data (with the reference)."""
        if reference not in self._diagnoses:
            served = [self.served_dump()]
            tp = int((self.server_info() or {}).get("tp_size") or 1) if self.client is not None else 1
            if self.capture_dir is not None and tp > 1:
                try:      # every rank's aux states: a per-rank partial value shows only across ranks
                    ranks = self.rank_dumps("aux")
                    served = ranks if len(ranks) == tp else served
                except Exception:  # noqa: BLE001 - rank 0's /generate capture still answers
                    pass
            self._diagnoses[reference] = diagnose(self.training, served,
                                                  draft_config=self.draft_dir, target_config=self.target_dir,
                                                  reference=self.reference_dump() if reference else None,
                                                  server=self.server_info(), max_samples=self.num_samples,
                                                  rules=self.rules)
        return self._diagnoses[reference]

    def spec_config(self):
        if self._spec is None:
            self._spec = self.client.effective_spec_config(
                self.requested, draft_config=self.draft_dir / "config.json")
        return self._spec

    def tensors(self, dump: Path) -> list[dict]:
        """Samples of a dump as ``{"input_ids": list, "hidden": Tensor}`` (small dumps only)."""

        src = read_dump(dump)
        return [{"input_ids": s.input_ids.tolist(), "hidden": s.load().to(torch.float32)}
                for s in src.samples]
