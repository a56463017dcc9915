#!/usr/bin/env bash
# Regenerate the reference models, their training data, the committed samples and the acceptance
# numbers, in order. Every step is seeded and prints progress.
#
#   env/models/regenerate.sh                 # CPU (nice 10): ~1 h on 2 idle cores, more when shared
#   DEVICE=cuda env/models/regenerate.sh     # steps 1-3 on a GPU (~4 min on one H200)
#
# PY: the suite interpreter (default .venv/bin/python); the SGLang steps (4, 5) need the server venv
# (env/reference/.venv or $E3F_SGLANG_PYTHON). The full training data (~0.5 GB) goes to
# env/models/cache/draft_data (git-ignored); only a 3-record sample is committed.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
DEVICE="${DEVICE:-cpu}"
RUN=(nice -n 10 "$PY")
cd "$HERE"
echo "[regenerate] 1/6 target (corpus -> tokenizer -> Llama 8x128)"
"${RUN[@]}" train_target.py --device "$DEVICE"
echo "[regenerate] 2/6 draft training data: self-distilled, HF capture, SpecForge format"
"${RUN[@]}" make_draft_data.py --device "$DEVICE" --out cache/draft_data
echo "[regenerate] 3/6 EAGLE-3 draft (TTT)"
"${RUN[@]}" train_draft.py --device "$DEVICE" --data cache/draft_data
echo "[regenerate] 4/6 committed samples: 3 records captured with HF (data/sample) and SGLang (data/sample_sglang)"
"${RUN[@]}" make_draft_data.py --device cpu --num 3 --sampled-frac 0 --out data/sample --vocab-from draft
"${RUN[@]}" make_draft_data.py --backend sglang --records-from data/sample --num 3 \
  --out data/sample_sglang --vocab-from draft
echo "[regenerate] 5/6 wiring-fault proxy and acceptance on real SGLang (TP 2) -> bench/RESULTS.md"
"${RUN[@]}" eval_draft_faults.py --device cpu --json draft/wiring_fault_eval.json
"${RUN[@]}" measure_acceptance.py --num 64 --new-tokens 64 --hf-check --results bench/RESULTS.md
echo "[regenerate] 6/6 second draft on out(4), out(5), out(6) for the fallback-ids case (draft_alt, data/sample_alt)"
"${RUN[@]}" make_draft_data.py --device "$DEVICE" --num 2400 --layer-ids 4 5 6 --vocab-from draft \
  --out cache/draft_data_alt
"${RUN[@]}" train_draft.py --device "$DEVICE" --data cache/draft_data_alt --out draft_alt --epochs 6
"${RUN[@]}" make_draft_data.py --device cpu --num 3 --sampled-frac 0 --layer-ids 4 5 6 --out data/sample_alt \
  --vocab-from draft_alt
