"""Test double: the real ``cleave-worker``, except that every result it returns cheats.

``CLEAVE_CHEAT`` names the cheat, one of ``bench.tile_cases.CHEATS`` (reduced-precision
operands, a uniform scale, sparse or single wrong entries, half of K, a replayed result,
zeros, a transposed operand): only ``TileComputer.compute`` is replaced, by the honest
product passed through that cheat. Each tile is logged to ``CLEAVE_CHEAT_LOG`` as
"cheated", or "honest" where the cheat had nothing to change (a replay needs an earlier
tile of the same shape), so the test can match the coordinator's verdicts to the truth.

Run as ``python tests/support/cheating_worker.py <cleave-worker arguments>``.
"""

from __future__ import annotations

import os
import sys

import torch

from bench.tile_cases import CHEATS
from client_app import cli
from client_app.compute import TileComputer

CHEAT = CHEATS[os.environ["CLEAVE_CHEAT"]]
LOG = os.environ["CLEAVE_CHEAT_LOG"]
_honest_compute = TileComputer.compute
_earlier: dict[tuple[int, ...], torch.Tensor] = {}  # the last result of each shape
_random = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


def _cheating_compute(
    self: TileComputer, op: str, a: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    c = _honest_compute(self, op, a, b)
    shape = tuple(c.shape)
    other = _earlier.get(shape, c)
    # A copy, as a replaying cheater keeps one: the worker reuses a product's memory for
    # a later product once its result is sent.
    _earlier[shape] = c.clone()
    bad = CHEAT(a, b, c, other, _random).contiguous()
    with open(LOG, "a") as fh:
        fh.write("honest\n" if torch.equal(bad, c) else "cheated\n")
    return bad


TileComputer.compute = _cheating_compute  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main())
