"""``python -m gradientmail_core.cli``: the same as the ``gradientmail`` console script."""

import sys

from . import main

sys.exit(main())
