"""Capacity planning from the accounting model: the critical batch B* of FSDP+TP training
(``bstar``, hardware profiles in ``profiles/``) and the measurement of a machine's profile
(``calibrate``). ``bstar`` is NumPy-free arithmetic; ``calibrate`` runs torch worlds."""
