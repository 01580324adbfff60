"""``python -m mirrorax``: the ``mirrorax`` command where its console script is not installed (a checkout on
``PYTHONPATH``, as on a shared accelerator host)."""

import sys

from mirrorax.cli import main

sys.exit(main())
