"""Test double: the real ``cleave-worker``, except that every Nth tile result is wrong.

One entry of every ``CLEAVE_PERTURB_EVERY``-th product is moved by a quarter of the
tile's largest magnitude: a subtle cheat (one number in thousands) that would still
poison training. Each computed tile is logged to ``CLEAVE_PERTURB_LOG`` as "honest" or
"perturbed", so the test can match the coordinator's verdicts against the truth.

Run as ``python tests/support/perturbing_worker.py <cleave-worker arguments>``.
"""

from __future__ import annotations

import os
import sys

import torch

from client_app import cli
from client_app.compute import TileComputer

EVERY = int(os.environ["CLEAVE_PERTURB_EVERY"])
LOG = os.environ["CLEAVE_PERTURB_LOG"]
_honest_compute = TileComputer.compute
_computed = 0


def _perturbing_compute(
    self: TileComputer, op: str, a: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    global _computed
    c = _honest_compute(self, op, a, b)
    _computed += 1
    perturb = _computed % EVERY == 0
    if perturb:
        flat = c.view(-1)
        flat[_computed % flat.numel()] += 0.25 * (float(c.abs().max()) + 1.0)
    with open(LOG, "a") as fh:
        fh.write("perturbed\n" if perturb else "honest\n")
    return c


TileComputer.compute = _perturbing_compute  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main())
