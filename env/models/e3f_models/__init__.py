"""eagle3-forensics reference models: tiny real-text targets and their EAGLE-3 drafts.

Layout (all under ``env/models/``):
  target/                 HF ``save_pretrained`` Llama target + tokenizer (bf16 safetensors)
  draft/                  EAGLE-3 draft in SGLang's ``LlamaForCausalLMEagle3`` layout
  prompts.json            held-out prompts (acceptance, distinct-4-gram)
  data/sample/            3 SpecForge-format records captured with HF transformers (as the draft's
                          training data was); data/sample_sglang/: the same records captured on SGLang
  data/validation/        the first 64 records of the draft's training-log validation split
  kimi/                   Kimi-class target (DeepseekV3: MLA + MoE), its Llama-style draft (draft/),
                          its MLA draft (draft_mla/, Eagle3DeepseekV2ForCausalLM), data/{sample,validation}
  llama_h64/              Llama target with 2 x 64 heads (vLLM CPU), its draft, data/{sample,validation}
  cache/                  git-ignored: corpus, full training data, logs

Import from a script or test with ``sys.path.insert(0, "<repo>/env/models")``.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import torch

MODELS_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = MODELS_DIR.parents[1]
TARGET_DIR = MODELS_DIR / "target"
DRAFT_DIR = MODELS_DIR / "draft"
PROMPTS_FILE = MODELS_DIR / "prompts.json"
SAMPLE_DIR = MODELS_DIR / "data" / "sample"
SAMPLE_SGLANG_DIR = MODELS_DIR / "data" / "sample_sglang"
VALIDATION_DIR = MODELS_DIR / "data" / "validation"
KIMI_DIR = MODELS_DIR / "kimi"
LLAMA_H64_DIR = MODELS_DIR / "llama_h64"
CACHE_DIR = Path(os.environ.get("E3F_MODELS_CACHE", MODELS_DIR / "cache"))

# SpecForge's default aux layer ids for an n-layer target, in SpecForge's out(i) convention
# (specforge/algorithms/model_providers.py::resolve_eagle_capture_layers): [1, n//2-1, n-4].
def specforge_default_layer_ids(n_layers: int) -> list[int]:
    """SpecForge default aux layer ids (out(i) convention) for an ``n_layers`` target."""
    return [1, n_layers // 2 - 1, n_layers - 4]


def seed_everything(seed: int, threads: int | None = None) -> None:
    """Seed python/numpy/torch; pin the CPU thread count; make CUDA fp32 and deterministic.

    On CUDA: TF32 off (fp32 matmuls, as on CPU), cuBLAS deterministic workspace,
    ``torch.use_deterministic_algorithms(True, warn_only=True)``.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if threads:
        torch.set_num_threads(threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def pick_device(name: str = "auto") -> torch.device:
    """``auto`` -> cuda when available, else cpu."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def write_json(path: Path, obj) -> None:
    """Write ``obj`` as indented JSON atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(path)
