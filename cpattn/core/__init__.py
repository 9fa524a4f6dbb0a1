"""The core layer: masks, layouts, block lists, local kernels, merges, the communicator, the step
language schedules declare (``steps``) and the one executor that runs it, the event simulator. It
imports nothing else of cpattn (docs/architecture.md)."""
