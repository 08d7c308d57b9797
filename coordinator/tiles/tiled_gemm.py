"""One offloaded GEMM: cut it into signed tile bundles, put returned tiles back together.

A ``TiledGemm`` lives from the moment the executor hands over ``a @ b`` until the last
tile is in. Tiles are encoded and signed once, on the executor's thread; re-issues send
the same bytes. K-split partial products are summed in K order when all have arrived,
so the result does not depend on which worker answered first.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.batches import BATCH_BELOW_BYTES
from common.frames import FrameParts
from common.messages import task_frame
from common.ops import TileOp
from common.task_messages import LazyTask
from common.tensors import Block, encode_block
from common.unfold import Unfold
from coordinator.plan.planner import GemmPlan, TileRegion, align_plan
from coordinator.schedule.scheduler import TileTicket
from coordinator.step.cpu_costs import COSTS
from coordinator.step.torch_threads import computing
from coordinator.tiles.step_blocks import StepBlocks


@dataclass(frozen=True)
class SignedTile:
    """Everything the server needs to send, check and deliver one tile."""

    tile_id: str
    gemm: TiledGemm
    region: TileRegion
    # The task with both operands, sent as is (also re-issued): signed, or a small one
    # signed when first sent alone (``LazyTask``).
    bundle: FrameParts | LazyTask
    # The operands as sent (Freivalds checks the result against them), each laid out
    # once for all the tiles that share it: tiles that share a row block of A (or a
    # column block of B) share its content id, and so do equal blocks of other GEMMs,
    # so a worker with an operand cache is sent each block once while it keeps it.
    a_block: Block
    b_block: Block
    ticket: TileTicket
    # Set when one operand is an image block standing for its patch matrix.
    unfold: Unfold | None = None

    @property
    def a(self) -> torch.Tensor:
        return self.a_block.tensor

    @property
    def b(self) -> torch.Tensor:
        return self.b_block.tensor

    @property
    def blocks(self) -> tuple[str, str]:
        """The operands' content ids (common.tensors.content_id)."""
        return self.a_block.id, self.b_block.id

    @property
    def flops(self) -> int:
        return self.ticket.flops

    @property
    def half(self) -> bool:
        """bf16 or fp16 operands: as fp32 the tile's bytes would be twice as many."""
        return self.a.element_size() == 2

    def block_bytes(self) -> tuple[int, int]:
        return self.a_block.nbytes, self.b_block.nbytes

    def task_frame(self, refs: frozenset[str], key: Ed25519PrivateKey) -> FrameParts | LazyTask:
        """The task for a worker with an operand cache: the shared bundle, or one in
        which the operands named in ``refs`` ("a", "b") are referred to by content id
        only (re-signed; nothing is copied or hashed again)."""
        if not refs:
            return self.bundle
        with COSTS.timed("sign_variant"):
            return task_frame(
                self.tile_id,
                self.gemm.op,
                self.a_block,
                self.b_block,
                key,
                refs=refs,
                unfold=self.unfold,
            )

    def matrices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The GEMM's operands, as the worker computes and the check reads them."""
        return (self.a, self.b) if self.unfold is None else self.unfold.matrices(self.a, self.b)

    @property
    def check_blocks(self) -> tuple[str, str]:
        """Block ids for the check's cache, which keeps summaries of the operands, not of
        their bytes: a transposed block's are its transpose's, an unfolded block's its
        patches'."""
        a_id, b_id = _check_id(self.a_block), _check_id(self.b_block)
        if self.unfold is None:
            return a_id, b_id
        tag = "|unfold" + json.dumps(self.unfold.to_header(), sort_keys=True)
        return (a_id + tag, b_id) if self.unfold.operand == "a" else (a_id, b_id + tag)

    def check_partners(self) -> list[tuple[str, torch.Tensor]]:
        """The B blocks (check id, operand) of the tiles in this tile's row of the grid
        that are not placed yet: the check makes their references with this one's, in
        one read of the A block (``coordinator.tiles.verify.check_product``)."""
        return self.gemm.row_partners(self.region)


def _check_id(block: Block) -> str:
    return block.id + ("|transposed" if block.transposed else "")


class TiledGemm:
    def __init__(
        self,
        gemm_id: str,
        plan: GemmPlan,
        a: torch.Tensor,
        b: torch.Tensor,
        on_done: Callable[[torch.Tensor], None],
        *,
        local: Collection[tuple[int, int, int, int]] = (),
        owners: Mapping[tuple[int, int, int, int], str] | None = None,
        unfold: Unfold | None = None,
        step_blocks: StepBlocks | None = None,
    ) -> None:
        """``step_blocks``: the blocks this step's GEMMs have cut so far, where a block
        cut again from unchanged memory may take an earlier cut's id and bytes."""
        self.gemm_id = gemm_id
        self._step_blocks = step_blocks
        self.unfold = unfold
        if unfold is not None:
            # Tiles cut between images (rows of the patches) and channels (columns).
            image = a if unfold.operand == "a" else b
            positions = math.prod(unfold.positions(image.shape[2], image.shape[3]))
            units = (
                (1, positions, 1, unfold.kernel_size)
                if unfold.operand == "a"
                else (1, 1, unfold.kernel_size, positions)
            )
            aligned = align_plan(plan, units)
            if aligned.grid != plan.grid:  # other tile indices: the planner's placement is void
                local, owners = (), None
            plan = aligned
            self._units = units
        # Tile indices the coordinator computes itself (compute_local) instead of sending.
        self.local = frozenset(local)
        # The worker the planner placed each tile on (TileTicket.planned_for).
        self.owners = dict(owners or {})
        self.plan = plan
        self.op = plan.shape.op
        self._a = a
        self._b = b
        self._on_done = on_done
        shape = plan.shape
        out_shape = (shape.batch, shape.m, shape.n) if self.op == TileOp.BMM else (shape.m, shape.n)
        self.out = torch.empty(out_shape, dtype=a.dtype)
        _gb, _gm, _gn, gk = plan.grid
        self._remaining = len(plan.tiles)
        self._partials: dict[tuple[int, int, int], dict[int, torch.Tensor]] = {}
        self._gk = gk
        self._lock = threading.Lock()
        self._delivered: set[tuple[int, int, int, int]] = set()
        # The B blocks of each row of the grid (batch, row, K block) by column, while
        # their tiles are out: what ``row_partners`` offers the check.
        self._rows: dict[tuple[int, int, int], dict[int, Block]] = {}

    def _operands(self, r: TileRegion) -> tuple[torch.Tensor, torch.Tensor]:
        """Strided views of the tile's operands (``encode_block`` lays each out once); an
        unfolded operand's view is the block of images and channels its patches span."""
        return self._operand("a", r), self._operand("b", r)

    def _operand(self, name: str, r: TileRegion) -> torch.Tensor:
        if self.unfold is not None:
            _, mu, nu, ku = self._units
            if self.unfold.operand == "a":
                if name == "a":
                    return self._a[r.m0 // mu : r.m1 // mu, r.k0 // ku : r.k1 // ku]
                return self._b[r.k0 : r.k1, r.n0 : r.n1]
            if name == "b":
                return self._b[r.k0 // ku : r.k1 // ku, r.n0 // nu : r.n1 // nu]
            return self._a[r.m0 : r.m1, r.k0 : r.k1]
        if self.op == TileOp.BMM:
            if name == "a":
                return self._a[r.b0 : r.b1, r.m0 : r.m1, r.k0 : r.k1]
            return self._b[r.b0 : r.b1, r.k0 : r.k1, r.n0 : r.n1]
        if name == "a":
            return self._a[r.m0 : r.m1, r.k0 : r.k1]
        return self._b[r.k0 : r.k1, r.n0 : r.n1]

    def iter_tiles(self, key: Ed25519PrivateKey) -> Iterator[SignedTile]:
        """Sign tiles one at a time, so the first can be on its way to a worker while
        the rest are still being cut. Each operand block is copied out of its matrix and
        hashed once, by the first tile that needs it (or by an earlier GEMM of the step,
        ``step_blocks``); the tiles sharing it send it from the same memory."""
        itemsize = self._a.element_size()
        blocks: dict[tuple[str, int, int, int], Block] = {}

        def block(at: tuple[str, int, int, int], region: TileRegion) -> Block:
            if at not in blocks:  # its view is made only here: slicing costs microseconds
                with COSTS.timed("cut"):
                    view = self._operand(at[0], region)
                    if self._step_blocks is None:
                        blocks[at], fresh = encode_block(view, share=True), True
                    else:
                        blocks[at], fresh = self._step_blocks.encode(view)
                if fresh:  # what was hashed
                    COSTS.add_bytes("cut", blocks[at].nbytes)
            return blocks[at]

        for region in self.plan.tiles:
            if region.index in self.local:
                continue
            tile_id = f"{self.gemm_id}/{'.'.join(map(str, region.index))}"
            bi, mi, ni, ki = region.index
            a, b = block(("a", bi, mi, ki), region), block(("b", bi, ki, ni), region)
            if self.unfold is None:  # an unfolded B is not the matrix the check reads
                with self._lock:
                    self._rows.setdefault((bi, mi, ki), {})[ni] = b
            # A small task is signed when it is sent alone, or not at all in a batch.
            small = a.nbytes + b.nbytes < BATCH_BELOW_BYTES
            with COSTS.timed("sign"):
                bundle = task_frame(tile_id, self.op, a, b, key, unfold=self.unfold, lazy=small)
            ticket = TileTicket(
                tile_id=tile_id,
                gemm_id=self.gemm_id,
                flops=region.flops,
                down_bytes=a.nbytes + b.nbytes,
                up_bytes=region.up_bytes(itemsize),
                blocks=(a.id, b.id),
                planned_for=self.owners.get(region.index),
                gemm_flops=self.plan.shape.flops,
            )
            yield SignedTile(tile_id, self, region, bundle, a, b, ticket, self.unfold)
        if not self.local:
            # Every tile now holds its own operands; the full matrices can go.
            self._a = self._b = torch.empty(0)

    def compute_local(self) -> bool:
        """Compute the tiles kept at the coordinator on the calling thread and place them
        (after iter_tiles has sent the rest, so workers compute meanwhile). Returns True
        when this completed the GEMM. They need no check: nobody else touched them."""
        finished = False
        for region in self.plan.tiles:
            if region.index in self.local:
                a, b = self._operands(region)
                if self.unfold is not None:
                    a, b = self.unfold.matrices(a, b)
                with COSTS.timed("kept_tiles"), computing():
                    c = torch.bmm(a, b) if self.op == TileOp.BMM else a @ b
                finished |= self.deliver(region, c)
        self._a = self._b = torch.empty(0)
        return finished

    def deliver(self, region: TileRegion, c: torch.Tensor, *, release: bool = True) -> bool:
        """Place a verified tile. Returns True when this completed the GEMM, which is then
        handed back to its waiter, unless ``release`` is False: then ``release()`` must
        follow (the server credits the last tile first)."""
        with self._lock:
            if region.index in self._delivered:
                return False
            self._delivered.add(region.index)
            bi, mi, ni, ki = region.index
            row = self._rows.get((bi, mi, ki))
            if row is not None:
                row.pop(ni, None)
                if not row:
                    del self._rows[(bi, mi, ki)]
            if self._gk == 1:
                self._write(region, c)
            else:
                parts = self._partials.setdefault((bi, mi, ni), {})
                parts[ki] = c
                if len(parts) == self._gk:
                    self._write_sum(region, [parts[k] for k in range(self._gk)])
                    del self._partials[(bi, mi, ni)]
            self._remaining -= 1
            finished = self._remaining == 0
        if finished and release:
            self.release()
        return finished

    def placed(self, region: TileRegion) -> bool:
        """Whether a result for ``region`` is in already."""
        with self._lock:
            return region.index in self._delivered

    def row_partners(self, region: TileRegion) -> list[tuple[str, torch.Tensor]]:
        """``SignedTile.check_partners`` of the tile at ``region``."""
        bi, mi, ni, ki = region.index
        with self._lock:
            row = self._rows.get((bi, mi, ki), {})
            others = [block for column, block in row.items() if column != ni]
        return [(_check_id(block), block.tensor) for block in others]

    def release(self) -> None:
        """Hand the whole GEMM to its waiter."""
        self._on_done(self.out)

    def _write(self, r: TileRegion, c: torch.Tensor) -> None:
        self._region(r).copy_(c)

    def _write_sum(self, r: TileRegion, parts: list[torch.Tensor]) -> None:
        """The K-split partial products of a region, added in K order. fp32 and fp64
        partials are added where the sum goes (never into a partial: it is a view of the
        bytes its result came in); half-precision ones add up in fp32 and round once, as
        a kernel accumulating the whole K range would."""
        wide = torch.promote_types(parts[0].dtype, torch.float32)
        if wide != parts[0].dtype:
            total = parts[0].to(wide)  # a sum of two bf16 partials would round in bf16
            for part in parts[1:]:
                total += part
            self._write(r, total)
            return
        # The first two summed straight into the region: one pass fewer than a copy of
        # the first followed by an add.
        total = torch.add(parts[0], parts[1], out=self._region(r))
        for part in parts[2:]:
            total += part

    def _region(self, r: TileRegion) -> torch.Tensor:
        if self.op == TileOp.BMM:
            return self.out[r.b0 : r.b1, r.m0 : r.m1, r.n0 : r.n1]
        return self.out[r.m0 : r.m1, r.n0 : r.n1]
