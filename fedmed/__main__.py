"""``python -m fedmed``: the ``fedmed`` command line."""

import sys

from fedmed.cli import main

sys.exit(main())
