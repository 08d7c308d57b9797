"""Test double: the real ``cleave-worker``, except that it reports ``CLEAVE_GFLOPS`` as its
speed in the Hello instead of measuring it.

What the cost planner sends a worker first depends on that figure, and a loaded machine
can measure anything: a test that needs the planner to offload fixes it here.

Run as ``python tests/support/fixed_speed_worker.py <cleave-worker arguments>``.
"""

from __future__ import annotations

import os
import sys
from functools import partial

from client_app import cli, profile, worker

worker.build_profile = partial(profile.build_profile, gflops=float(os.environ["CLEAVE_GFLOPS"]))

if __name__ == "__main__":
    sys.exit(cli.main())
