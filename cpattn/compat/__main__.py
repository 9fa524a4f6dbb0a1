"""Run code that cannot be edited on cpattn's stand-ins::

    python -m cpattn.compat --as ring_flash_attn,yunchang -m some.framework.train ARGS
    python -m cpattn.compat --as yunchang path/to/script.py ARGS
    torchrun --nproc-per-node 8 -m cpattn.compat --as ring_flash_attn -m some.framework.train ARGS

installs the named stand-ins (:func:`cpattn.compat.install`), then runs the target as ``__main__`` with its
arguments, as ``python -m`` or ``python script.py`` would (``sys.argv``, and ``sys.path[0]``: the current
directory for a module, the script's directory for a script). The target's exit status is the runner's:
``sys.exit`` codes pass through, an uncaught exception prints its traceback and exits with 1.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from . import MODULES, install

USAGE = ("python -m cpattn.compat --as NAME[,NAME...] (-m MODULE | SCRIPT) [ARGS...]\n"
         f"NAME: {', '.join(sorted(MODULES))}")


def _parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog="python -m cpattn.compat", usage=USAGE,
                                   description="Run a module or script with cpattn's stand-ins installed.")


def split(argv: list[str]) -> tuple[list[str], str | None, str | None, list[str]]:
    """``argv`` (after the program name) -> (names to install, module or None, script or None, the target's
    arguments). Everything after the module or script belongs to the target, unread."""
    parser = _parser()
    names: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            parser.print_help()
            raise SystemExit(0)
        if arg == "--as" or arg.startswith("--as="):
            value = arg[len("--as="):] if arg.startswith("--as=") else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if arg.startswith("--as=") else 2
            names += [n for n in value.split(",") if n]
            if not value:
                parser.error("--as needs a comma-separated list of libraries")
            continue
        if arg == "-m":
            if i + 1 >= len(argv):
                parser.error("-m needs a module name")
            return names, argv[i + 1], None, argv[i + 2:]
        if arg.startswith("-"):
            parser.error(f"unknown option {arg!r} before the target (the target's own options come after it)")
        return names, None, arg, argv[i + 1:]
    parser.error("no target: give -m MODULE or a script path")
    raise AssertionError  # parser.error exits


def main(argv: list[str] | None = None) -> None:
    """Install, then run the target as ``__main__``; its ``SystemExit`` and exceptions propagate."""
    names, module, script, args = split(sys.argv[1:] if argv is None else argv)
    if not names:
        _parser().error(f"--as names no library; available: {', '.join(sorted(MODULES))}")
    for name in names:
        try:
            install(name)
        except (ValueError, ImportError) as exc:
            _parser().error(str(exc))
    if module is not None:
        sys.argv = [module, *args]  # runpy puts the module's file in argv[0], as python -m does
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        if not os.path.exists(script):
            _parser().error(f"can't open file {script!r}: no such file")
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
