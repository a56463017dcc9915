"""The load ``watch`` puts on the server it watches (issue 36: under 1 %), against a fake SGLang server in this process
(tests/support/fakeserver.py mode ``metrics``) whose counters grow at a stated load besides the probe.

A thread adds ``--load`` generated tokens per second to the fake's cumulative counters
(``sglang:generation_tokens_total`` and ``sglang:spec_verify_calls_total`` at an accept length of 2.5), as other
users' traffic would; ``watch``'s own sampler (:class:`helpers.acceptance.watch.Watcher`, the probe of
``--probe-tokens`` greedy tokens, the lifecycle's fixed probe of 16 and ``/server_info`` + ``/model_info`` unless
``--no-events``, and one ``/metrics`` read per interval) runs ``--samples`` intervals of
``--interval`` s. Printed per run, from the samples' own ``load`` records (what ``watch`` records and prints on
every line):

* ``token share``: the probe's tokens / the server's generated tokens over each interval (median, max);
* ``time share``: the probe's request seconds / the interval (on the fake, which answers at once: an upper bound
  of the client side only, not a real server's decode time);
* ``sampler``: the client's seconds per sample (probe + /metrics + the detector over the window);
* the token share extrapolated to the default 30 s interval: probe tokens / (load x 30).

    .venv/bin/python bench/bench_watch.py                     # 2000 tok/s, 8 samples of 2 s
    .venv/bin/python bench/bench_watch.py --load 500 --interval 1 --samples 10

Record the line in bench/RESULTS.md with the date and the machine's load.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from helpers.acceptance.prompts import load_prompts  # noqa: E402
from helpers.acceptance.watch import Watcher, WatchLog, WatchSettings, probe_once, read_log  # noqa: E402
from helpers.draft.decide import threshold  # noqa: E402
from helpers.acceptance.lifecycle import FIXED_NEW_TOKENS, for_server  # noqa: E402
from helpers.engines.detect import detect  # noqa: E402
from support import fakeserver  # noqa: E402


class _Metrics(fakeserver.Handler):
    mode = "metrics"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", type=float, default=2000.0, help="other traffic, generated tokens per second")
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--probe-tokens", type=int, default=16)
    ap.add_argument("--no-events", action="store_true", help="no lifecycle observation (watch --no-events); by "
                    "default the fixed probe, /server_info and /model_info per interval, as watch does")
    args = ap.parse_args()

    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    stop = threading.Event()

    def traffic():
        last = time.monotonic()
        while not stop.wait(0.05):
            now = time.monotonic()
            tok = args.load * (now - last)
            last = now
            fakeserver.METRICS["generation_tokens"] += tok
            fakeserver.METRICS["verify_steps"] += tok / 2.5

    threading.Thread(target=traffic, daemon=True).start()
    found = detect(url, deadline_s=10)
    client = found.adapter.client(url, timeout=10, retries=0)
    prompts = iter(load_prompts(None) * 100)
    with tempfile.TemporaryDirectory() as tmp:
        w = Watcher(WatchLog(tmp), snapshot=lambda: found.adapter.watch_snapshot(client.metrics_text()),
                    probe=lambda: probe_once(client, next(prompts), max_new_tokens=args.probe_tokens, timeout=10),
                    settings=WatchSettings(material=threshold),
                    lifecycle=None if args.no_events else for_server(client, found.adapter, probe_timeout=10,
                                                                     request_timeout=10))
        took = []
        next_t = time.monotonic()
        for _ in range(args.samples):
            t0 = time.perf_counter()
            w.step()
            took.append(time.perf_counter() - t0)
            next_t += args.interval
            time.sleep(max(0.0, next_t - time.monotonic()))
        w.log.close()
        recs = [r for r in read_log(Path(tmp) / "watch.jsonl").records if r["kind"] == "sample"][1:]
    stop.set()
    client.close()
    srv.shutdown()
    tok = [r["load"]["probe_token_share"] for r in recs if r["load"]["probe_token_share"] is not None]
    tim = [r["load"]["probe_time_share"] for r in recs if r["load"]["probe_time_share"] is not None]
    own = args.probe_tokens + (0 if args.no_events else FIXED_NEW_TOKENS)     # the light probe's + the fixed probe's
    at30 = own / (args.load * 30.0)
    expected = own / (own + args.load * args.interval)
    print(f"load {args.load:.0f} tok/s, interval {args.interval:g} s, {len(recs)} intervals, probe "
          f"{args.probe_tokens} tokens{'' if args.no_events else ' + the fixed probe ' + str(FIXED_NEW_TOKENS)}: "
          f"token share median {100 * statistics.median(tok):.3f} % max "
          f"{100 * max(tok):.3f} % (expected {100 * expected:.3f} %); time share median "
          f"{100 * statistics.median(tim):.3f} %; sampler {1000 * statistics.median(took):.1f} ms"
          f" per sample; at the default 30 s interval: token share {100 * at30:.4f} %; host load "
          f"{os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
