"""``python -m cpattn.train ...``: one rank of a training run under torchrun
(``torchrun --nproc-per-node N -m cpattn.train ...``; :func:`cpattn.train.main`)."""

from .cli_args import main

if __name__ == "__main__":
    raise SystemExit(main())
