"""``python -m fedmed``: the ``fedmed`` command line."""

import sys

from fedmed.cli.main import main

sys.exit(main())
