"""A clone's entry point of fedmed's job builder, :mod:`fedmed_flare.build` (installed with fedmed; ``fedmed job
build`` and ``python -m fedmed_flare.build`` are the same program):

    python jobs/build.py --config app_configs/busi_fmcl.yaml --method FedAvg --out JOBS
"""

import sys

from fedmed_flare.build import main

if __name__ == "__main__":
    sys.exit(main())
