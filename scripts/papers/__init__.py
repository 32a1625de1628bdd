"""The papers' claims beside the simulator (``scripts/reproduce_papers.py`` runs them): per
paper a data file of its claims (``NAME.toml``, :mod:`papers.claims` describes it) and the
module that prices each claim's setting (``NAME.py``, its ``SECTIONS``)."""
