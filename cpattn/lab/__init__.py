"""Lab code, apart from the library users import: measuring this machine (``calibrate``) and the
papers' evaluations in the cost model (``reproduce``). The ``cpattn calibrate`` and ``cpattn reproduce``
commands run it; nothing in the core, the schedules or the model imports it."""
