"""An investigation of a server: find the fault, propose the fix, prove it.

* :mod:`.live` -- the live investigation of a running server, blind (``python -m helpers investigate``);
* :mod:`.propose` -- the proposed fix from a diagnosis (ids from SGLang's rules, flags, d2t, engine changes) and
  draft variants that carry it;
* :mod:`.checks` / :mod:`.catalog` -- the named checks (hypotheses settled by measurements);
* :mod:`.cases` / :mod:`.replay` -- case files and their replay on fresh servers (the main job's demonstration).
"""
