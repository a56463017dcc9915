"""An EAGLE-3 draft on its own: checks that need no server, its training log, its offline run and simulated drafting."""
