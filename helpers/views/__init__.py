"""What the notebooks show, one module per page (``investigation``, ``replay``, ``attach``, ``dump``, ``compare``,
``hypotheses``, ``acceptance``, ``postmortem``) plus :mod:`.common` (run context, HTML, plotly renderer, widgets,
results between pages). Notebooks hold prose and calls into these modules."""
