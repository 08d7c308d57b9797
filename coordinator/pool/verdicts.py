"""What a finished check does: a verified tile is credited (and its worker sent more), a
wrong one re-issued and its worker's reputation cut, down to a ban."""

from __future__ import annotations

import logging

from common.errors import ErrorCode
from common.messages import Error
from coordinator.pool.core_api import CoreApi
from coordinator.pool.effects import Check, Checked, CloseCode, Effects
from coordinator.pool.reputation import after_failed, after_verified, ban_reason, is_banned
from coordinator.pool.workers import Worker
from coordinator.schedule.scheduler import Verdict
from coordinator.tiles.verify import CheckReason, CheckResult

log = logging.getLogger("cleave.coordinator")


def judge(core: CoreApi, worker: Worker, check: Check, outcome: Checked, effects: Effects) -> bool:
    """Credit a verified tile (and send its worker more), or fail it. True when its
    worker was credited (so what its tiles teach of its speed moved)."""
    now = core.now
    worker.verifying.discard(check.tile_id)
    if outcome.late:  # neither credited nor held against it: nobody checked it
        core.counters.duplicates += 1
        return False
    result = outcome.result
    if outcome.error is not None:
        # Counted as a wrong result (it is one), and the sender is told why.
        error = outcome.error
        log.warning("worker %s sent an undecodable result: %s", worker.who, error.message)
        effects.send(worker.worker_id, Error(error.code, error.message, check.tile_id))
    if result is None or not result.ok:
        failed_check(core, worker, check.tile_id, effects, result)
        return False
    tile = check.tile
    completion = core.scheduler.complete(worker.worker_id, check.tile_id, now)
    if completion.verdict is not Verdict.ACCEPTED:
        core.counters.duplicates += 1
        placed_anyway(core, check, outcome, effects)
        return False
    core.tiles.pop(check.tile_id, None)
    held_s = now - worker.sent_at.pop(check.tile_id, now)
    up = check.up_bytes
    worker.learn(tile, check.compute_s, held_s, up, now)
    worker.tiles_session += 1
    counters = core.counters
    counters.tiles_verified += 1
    counters.compute_s += min(check.compute_s, held_s)
    counters.bytes_up += up
    if tile.half:
        counters.bytes_half += up
    before = core.ledger.get(worker.key)
    core.ledger.credit(
        worker.key,
        name=worker.name,
        reputation=after_verified(before.reputation, core.config.reputation),
        flops=tile.flops,
        bytes_down=worker.sent_bytes.pop(check.tile_id, len(tile.bundle)),
        bytes_up=up,
        compute_s=min(check.compute_s, held_s),
        now=core.wall_time(),
        ticket=tile.ticket,
    )
    for other in completion.cancel:
        core.cancel(other, check.tile_id, effects)
    core.dispatch(effects)
    return True


def placed_anyway(core: CoreApi, check: Check, outcome: Checked, effects: Effects) -> None:
    """A verified result the scheduler no longer takes from its worker (it left, or
    handed the tile on) is in its GEMM all the same: unless another result already
    closed the tile, the copies handed on are cancelled, so that nobody is credited
    for a tile the step did not use."""
    if outcome.result is None or not outcome.result.ok:
        return
    if core.tiles.pop(check.tile_id, None) is None:
        return  # another result was accepted (and placed) first
    for holder in core.scheduler.take_over(check.tile_id):
        core.cancel(holder, check.tile_id, effects)


def failed_check(
    core: CoreApi, worker: Worker, tile_id: str, effects: Effects, check: CheckResult | None
) -> None:
    """A wrong result: discard it, re-issue the tile, cut the worker's reputation, and
    ban its key (closing all its connections) once the reputation falls too low."""
    core.counters.rejected += 1
    policy = core.config.reputation
    before = core.ledger.get(worker.key)
    reputation = after_failed(before.reputation, policy)
    banned = ""
    if not before.banned_reason and is_banned(reputation, policy):
        banned = ban_reason(before.rejected + 1, reputation)
    core.ledger.reject(
        worker.key,
        name=worker.name,
        reputation=reputation,
        banned_reason=banned,
        now=core.wall_time(),
    )
    log.warning(
        "tile %s from %s failed verification (%s; reputation %.2f): re-issuing",
        tile_id,
        worker.who,
        _why(check),
        reputation,
    )
    worker.sent_at.pop(tile_id, None)
    core.scheduler.reject(worker.worker_id, tile_id, core.now, reason="failed verification")
    # Tell the worker: an honest volunteer with faulty hardware should learn of it.
    effects.send(
        worker.worker_id,
        Error(
            ErrorCode.FAILED_CHECK,
            f"the result failed verification and was discarded; reputation now {reputation:.2f}",
            tile_id,
        ),
    )
    if banned:
        core.counters.banned += 1
        log.warning("banning worker %s: %s", worker.who, banned)
        for other in [w for w in core.workers.values() if w.key == worker.key]:
            effects.send(other.worker_id, Error(ErrorCode.BANNED, f"banned: {banned}"))
            core.drop(other, CloseCode.POLICY, f"banned: {banned}", effects)
    core.dispatch(effects)
    core.rescue_stranded(effects)


def _why(check: CheckResult | None) -> str:
    if check is None:
        return "undecodable"
    if check.reason is CheckReason.MISMATCH:
        return f"{check.margin:.3g}x its rounding threshold"
    return str(check.reason)
