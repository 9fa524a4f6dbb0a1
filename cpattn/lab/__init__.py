"""Lab code, apart from the library users import: measuring this machine into a cost-model profile
(``machine_profile``) and the papers' evaluations in the cost model (``papers``). The ``cpattn calibrate``
and ``cpattn reproduce`` commands run it; nothing in the core, the schedules or the model imports it."""
