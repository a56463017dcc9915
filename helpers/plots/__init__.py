"""Plotly figures: acceptance per fix (:mod:`.acceptance`) and the hypothesis checks' figures (:mod:`.checks`)."""
