"""An investigation of a server: the named checks (hypotheses settled by measurements, :mod:`.checks`), case files\n(:mod:`.cases`) and their replay on fresh servers (:mod:`.replay`)."""
