#!/usr/bin/env python
"""Accept length / accept rate / tok/s of the reference draft on real SGLang (CPU), and a check
that EAGLE-3 output equals target-only greedy output.

Two servers, one after the other, both TP ``--tp`` (default 2), ``--dtype float32``:
  target-only, then EAGLE-3 (steps 3, topk 1, 4 draft tokens). Prompts: env/models/prompts.json
(held-out corpus paragraphs), sent one at a time as token ids, temperature 0, ``ignore_eos``.
Optionally (``--hf-check``) the target-only tokens are also compared with HF transformers greedy.

    python env/models/measure_acceptance.py --num 64 --new-tokens 64 --results bench/RESULTS.md
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # repo root: helpers.server.embedded

from e3f_models import CACHE_DIR, DRAFT_DIR, PROMPTS_FILE, REPO_ROOT, TARGET_DIR, write_json  # noqa: E402
from e3f_models.measure import run_prompts, summarize  # noqa: E402

SECTION = "## Reference models: acceptance (env/models)"


def measure(target: Path, draft: Path, prompts: list[list[int]], new_tokens: int, tp: int,
            steps: int = 3, topk: int = 1, num_draft_tokens: int = 4) -> dict:
    """Run target-only and EAGLE-3 servers over ``prompts``; return summaries and records."""
    out = {}
    for name, d in (("target_only", None), ("eagle3", draft)):
        t = time.time()
        print(f"[{name}] starting SGLang (TP {tp}) ...", flush=True)
        from helpers.server import embedded
        from helpers.server.settings import SpecSettings
        spec = SpecSettings(algorithm="EAGLE3", num_steps=steps, topk=topk, num_draft_tokens=num_draft_tokens) if d else None
        with embedded.start(Path(target).resolve(), d and Path(d).resolve(), tp=tp, spec=spec,
                            return_hidden_states=False, enable_metrics=False,
                            timeout=600) as srv:
            startup = time.time() - t
            recs = run_prompts(srv.url, prompts, new_tokens)
        out[name] = {"summary": summarize(recs, num_draft_tokens), "records": recs,
                     "startup_s": round(startup, 1)}
        print(f"[{name}] {json.dumps(out[name]['summary'])}", flush=True)
    a = [r["output_ids"] for r in out["target_only"]["records"]]
    b = [r["output_ids"] for r in out["eagle3"]["records"]]
    out["identical_outputs"] = sum(x == y for x, y in zip(a, b))
    out["first_mismatch"] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return out


def hf_greedy(target: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from e3f_models.target import greedy_continue, load_target
    return greedy_continue(load_target(target), prompts, new_tokens, batch_size=16,
                           stop_at_eos=False)


def results_markdown(res: dict, args) -> str:
    t, e = res["target_only"]["summary"], res["eagle3"]["summary"]
    n = t["requests"]
    tc = json.loads((Path(args.target) / "config.json").read_text())
    ids = json.loads((Path(args.draft) / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"]
    hist = e.get("correct_drafts_histogram") or []
    tot = sum(hist) or 1
    lines = [
        SECTION, "",
        f"Measured {time.strftime('%Y-%m-%d')} by `env/models/measure_acceptance.py` on the embedded "
        f"CPU reference server (`helpers.server.embedded`: SGLang 0.5.23, `--dtype float32`, TP {args.tp}, "
        f"1 thread per rank, `--attention-backend intel_amx` through the sgl_kernel stand-in), host "
        f"`{platform.machine()}` with {args_cpu()} CPU cores shared with other jobs, so tok/s is "
        "indicative only.",
        "",
        f"Target `env/models/target` (Llama, {tc['num_hidden_layers']} layers, hidden "
        f"{tc['hidden_size']}), draft `env/models/draft` (EAGLE-3, trained on aux layers SpecForge "
        f"{', '.join(f'out({i})' for i in ids)}). {n} held-out prompts "
        f"(`env/models/prompts.json`), one request at a time, {args.new_tokens} new tokens, "
        "temperature 0, `ignore_eos`. EAGLE-3: `--speculative-num-steps 3 "
        "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4`.",
        "",
        "| run | accept length | accept rate | tok/s (batch 1) | completion tokens | verify steps |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| target only | - | - | {t['tok_per_s']:.1f} | {t['completion_tokens']} | - |",
        f"| EAGLE-3 (reference draft) | {e['accept_length']:.3f} | {e['accept_rate']:.3f} | "
        f"{e['tok_per_s']:.1f} | {e['completion_tokens']} | {e['spec_verify_ct']} |",
        "",
        f"- accept length = sum completion_tokens / sum spec_verify_ct (bonus token included); "
        f"mean of per-request `spec_accept_length`: {e['per_request_accept_length_mean']:.3f}.",
        f"- accept rate = sum spec_num_correct_drafts / sum spec_num_proposed_drafts "
        f"({e['correct_drafts']} / {e['proposed_drafts']}).",
        "- verify steps by number of correct drafts (0..3): "
        + ", ".join(f"{i}: {c} ({c / tot:.0%})" for i, c in enumerate(hist)) + ".",
        f"- EAGLE-3 output tokens identical to target-only greedy output: "
        f"{res['identical_outputs']}/{n} requests"
        + (f"; identical to HF transformers greedy: {res['hf_identical']}/{n}"
           if "hf_identical" in res else "") + ".",
        f"- speed-up (EAGLE-3 tok/s / target-only tok/s): {e['tok_per_s'] / t['tok_per_s']:.2f}x "
        "(on CPU the draft + verify overhead of a 2-core host dominates; the accept length is "
        "the number that transfers).",
        f"- server start-up: target-only {res['target_only']['startup_s']} s, EAGLE-3 "
        f"{res['eagle3']['startup_s']} s.",
        "- how the draft was trained (target continuations sampled at temperature 1) and how much "
        "accept length each classic wiring fault costs it: `env/models/README.md`.",
        "",
    ]
    return "\n".join(lines)


def args_cpu() -> int:
    import os
    return os.cpu_count() or 0


def write_section(path: Path, text: str) -> None:
    """Replace (or append) the ``SECTION`` of ``path``, leaving other sections alone."""
    old = path.read_text() if path.exists() else "# Benchmark results\n\n"
    if SECTION in old:
        head, rest = old.split(SECTION, 1)
        nxt = rest.find("\n## ")
        tail = rest[nxt + 1:] if nxt >= 0 else ""
        new = head + text + ("\n" + tail if tail else "")
    else:
        new = old.rstrip("\n") + "\n\n" + text
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", type=Path, default=TARGET_DIR)
    ap.add_argument("--draft", type=Path, default=DRAFT_DIR)
    ap.add_argument("--num", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--hf-check", action="store_true")
    ap.add_argument("--results", type=Path, default=None, help="markdown file to update")
    ap.add_argument("--json", type=Path, default=CACHE_DIR / "acceptance.json")
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(a.target))
    texts = json.loads(PROMPTS_FILE.read_text())["prompts"][: a.num]
    prompts = [tok(t)["input_ids"] for t in texts]
    res = measure(a.target, a.draft, prompts, a.new_tokens, a.tp)
    if a.hf_check:
        hf = hf_greedy(a.target, prompts, a.new_tokens)
        res["hf_identical"] = sum(x == r["output_ids"] for x, r in
                                  zip(hf, res["target_only"]["records"]))
    res["args"] = {k: str(v) for k, v in vars(a).items()}
    write_json(a.json, res)
    e, t = res["eagle3"]["summary"], res["target_only"]["summary"]
    print(f"[done] accept length {e['accept_length']:.3f}, accept rate {e['accept_rate']:.3f}, "
          f"tok/s {e['tok_per_s']:.1f} (EAGLE-3) vs {t['tok_per_s']:.1f} (target only); identical "
          f"outputs {res['identical_outputs']}/{len(prompts)}"
          + (f"; HF identical {res['hf_identical']}/{len(prompts)}" if a.hf_check else ""))
    if a.results:
        path = a.results if a.results.is_absolute() else REPO_ROOT / a.results
        write_section(path, results_markdown(res, a))
        print(f"[results] {path}")
    return 0 if res["identical_outputs"] == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
