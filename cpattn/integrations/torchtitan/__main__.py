"""``python -m cpattn.integrations.torchtitan [torchtitan flags]`` (under torchrun): torchtitan's trainer
on this package's configs (``--module cpattn.integrations.torchtitan --config llama3_debugmodel`` unless
given)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    given = {a.split("=", 1)[0] for a in args}
    if "--module" not in given:
        args = ["--module", "cpattn.integrations.torchtitan", *args]
    if "--config" not in given:
        args = ["--config", "llama3_debugmodel", *args]
    from . import shims

    shims.apply()
    from torchtitan import train

    sys.argv = [sys.argv[0], *args]
    train.main()


if __name__ == "__main__":
    main()
