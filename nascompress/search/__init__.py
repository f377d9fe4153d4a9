"""The Optuna searches over compression settings (``nascompress search tokens``/``joint``, studies):
search spaces (``space*``), samplers, scoring and the trials. The DCS channel search is
:mod:`nascompress.dcs_search`."""
