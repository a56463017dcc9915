"""The wiring diagnosis: is what the server feeds the draft what the draft was trained on?

* :mod:`.conventions` -- capture plans (served and training) from the layer vocabulary and SGLang's rules of
  :mod:`helpers.layers`; :mod:`.sglang_rules` -- whether SGLang can serve a draft as an EAGLE-3 draft;
* :mod:`.static` -- the one static check (configs x SGLang rules x training plan with its provenance);
* :mod:`.compare` -- token-aligned, per-row comparison of served chunks with training chunks and reference layers;
* :mod:`.fit` -- transform fits (isometry, RMS norm) and the engine noise floor;
* :mod:`.detectors` -- one detector per finding kind (the vocabulary of findings);
* :mod:`.diagnose` -- static + numeric diagnosis (the ``diagnose`` command's library);
* :mod:`.synthetic` -- synthetic targets with real residual-stream statistics (tests and benches).
"""
