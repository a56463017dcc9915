"""Acceptance of a draft on a live server: what the draft earns, measured.

* :mod:`.prompts` -- prompt sets (bundled, files, training samples);
* :mod:`.requests` -- one request per prompt, the spec fields of each answer;
* :mod:`.stats` -- the one definition of accept length (tokens per verify step, bonus token included) and accept
  rate, bootstrap and paired CIs, the one CI formatter;
* :mod:`.measure` -- one measurement (summary, per request, per position), saved as one unit, never overwritten;
* :mod:`.ledger` -- the append-only ledger of measured fixes;
* :mod:`.fixes` -- the fixes file and managed mode (a server per fix).
"""
