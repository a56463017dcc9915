#!/usr/bin/env bash
# Regenerate the reference models, their training data, the committed samples and the acceptance
# numbers, in order. Every step is seeded and prints progress.
#
#   env/models/regenerate.sh                 # CPU (nice 10): ~1 h on 2 idle cores, more when shared
#   DEVICE=cuda env/models/regenerate.sh     # steps 1-3 and 7-9 on a GPU (~4 min + ~8 min on one H200)
#
# PY: the suite interpreter (default .venv/bin/python); the SGLang steps (4, 5) need the server venv
# (env/reference/.venv or $E3F_SGLANG_PYTHON). The full training data (~0.5 GB) goes to
# env/models/cache/draft_data (git-ignored); only a 16-record sample is committed (enough for the budget to decide the wiring stage, >= SMALL_N = 10 sequences).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
DEVICE="${DEVICE:-cpu}"
RUN=(nice -n 10 "$PY")
cd "$HERE"
echo "[regenerate] 1/9 target (corpus -> tokenizer -> Llama 8x128)"
"${RUN[@]}" train_target.py --device "$DEVICE"
echo "[regenerate] 2/9 draft training data: self-distilled, HF capture, SpecForge format"
"${RUN[@]}" make_draft_data.py --device "$DEVICE" --out cache/draft_data
echo "[regenerate] 3/9 EAGLE-3 draft (TTT)"
"${RUN[@]}" train_draft.py --device "$DEVICE" --data cache/draft_data
echo "[regenerate] 4/9 committed samples: 16 records captured with HF (data/sample), the first 3 on SGLang (data/sample_sglang)"
"${RUN[@]}" make_draft_data.py --device cpu --num 16 --sampled-frac 0 --out data/sample --vocab-from draft
"${RUN[@]}" make_draft_data.py --backend sglang --records-from data/sample --num 3 \
  --out data/sample_sglang --vocab-from draft
echo "[regenerate] 5/9 wiring-fault proxy and acceptance on real SGLang (TP 2) -> bench/RESULTS.md"
"${RUN[@]}" eval_draft_faults.py --device cpu --json draft/wiring_fault_eval.json
"${RUN[@]}" measure_acceptance.py --num 64 --new-tokens 64 --hf-check --results bench/RESULTS.md
echo "[regenerate] 6/9 second draft on out(4), out(5), out(6) for the fallback-ids case (draft_alt, data/sample_alt)"
"${RUN[@]}" make_draft_data.py --device "$DEVICE" --num 2400 --layer-ids 4 5 6 --vocab-from draft \
  --out cache/draft_data_alt
"${RUN[@]}" train_draft.py --device "$DEVICE" --data cache/draft_data_alt --out draft_alt --epochs 6
"${RUN[@]}" make_draft_data.py --device cpu --num 3 --sampled-frac 0 --layer-ids 4 5 6 --out data/sample_alt \
  --vocab-from draft_alt
echo "[regenerate] 7/9 validation rows of the reference draft: the first 64 of its log's validation split (data/validation)"
"${RUN[@]}" export_validation.py --device "$DEVICE" --data cache/draft_data --draft draft --target target --num 64 \
  --out data/validation
echo "[regenerate] 8/9 Kimi-class target (DeepseekV3: MLA + MoE), its Llama-style and MLA drafts, samples, validation rows"
"${RUN[@]}" train_target.py --device "$DEVICE" --family kimi --tokenizer-from target --out kimi/target
"${RUN[@]}" make_draft_data.py --device "$DEVICE" --target kimi/target --batch-size 256 --out cache/kimi_data
"${RUN[@]}" train_draft.py --device "$DEVICE" --target kimi/target --data cache/kimi_data --out kimi/draft
"${RUN[@]}" train_draft.py --device "$DEVICE" --arch mla --target kimi/target --data cache/kimi_data --out kimi/draft_mla
"${RUN[@]}" export_validation.py --device "$DEVICE" --data cache/kimi_data --draft kimi/draft --draft kimi/draft_mla \
  --target kimi/target --num 48 --out kimi/data/validation
"${RUN[@]}" make_draft_data.py --device cpu --num 16 --sampled-frac 0 --target kimi/target --out kimi/data/sample \
  --vocab-from kimi/draft
echo "[regenerate] 8b/9 the Kimi-class target's NextN / MTP head (model.layers.8.* into kimi/target/model.safetensors)"
# teacher-forced corpus text (no generation: the committed head was trained this way on 2 shared CPU cores)
"${RUN[@]}" make_draft_data.py --device "$DEVICE" --num 1500 --text-len 96 --target kimi/target --batch-size 64 \
  --out cache/kimi_text
"${RUN[@]}" train_nextn.py --device "$DEVICE" --target kimi/target --data cache/kimi_text --epochs 2
echo "[regenerate] 9/9 Llama with 2 x 64 heads (vLLM CPU), its draft, samples, validation rows"
"${RUN[@]}" train_target.py --device "$DEVICE" --num-heads 2 --num-kv-heads 2 --tokenizer-from target --out llama_h64/target
"${RUN[@]}" make_draft_data.py --device "$DEVICE" --target llama_h64/target --batch-size 256 --out cache/h64_data
"${RUN[@]}" train_draft.py --device "$DEVICE" --target llama_h64/target --data cache/h64_data --out llama_h64/draft
"${RUN[@]}" export_validation.py --device "$DEVICE" --data cache/h64_data --draft llama_h64/draft --target llama_h64/target \
  --num 48 --out llama_h64/data/validation
"${RUN[@]}" make_draft_data.py --device cpu --num 16 --sampled-frac 0 --target llama_h64/target --out llama_h64/data/sample \
  --vocab-from llama_h64/draft
# the EAGLE-1 draft for vLLM's method eagle (CPU; samples its own data from the target)
"${RUN[@]}" train_eagle1.py --target llama_h64/target --out llama_h64/draft_eagle1
# the MiMo MTP head of the pair make_mimo_pair.py assembles (CPU; the EAGLE-1 draft's sampled sequences, cached ids)
"${RUN[@]}" train_mimo_mtp.py --target llama_h64/target --out llama_h64/mimo_mtp
