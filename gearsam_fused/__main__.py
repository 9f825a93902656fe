"""``python -m gearsam_fused``: the ``gearsam`` command, which lives in :mod:`gearsam_fused.app.cli`."""

import sys

from .app.cli import main

if __name__ == "__main__":
    sys.exit(main())
