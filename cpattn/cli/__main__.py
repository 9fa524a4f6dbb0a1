"""``python -m cpattn.cli``."""

import sys

from . import main

sys.exit(main())
