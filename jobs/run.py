"""A clone's entry point of fedmed's job runner, :mod:`fedmed_flare.run` (installed with fedmed; ``fedmed job run``
and ``python -m fedmed_flare.run`` are the same program):

    python jobs/run.py --config CONFIG --method NAME --env sim --datalists DIR --workspace WS
    python jobs/run.py --config CONFIG --method NAME --env prod --startup-kit ADMIN_KIT --result-dir DIR
"""

import sys

from fedmed_flare.run import main

if __name__ == "__main__":
    sys.exit(main())
