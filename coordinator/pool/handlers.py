"""What each message a worker sends does to the core's state: one handler per type
(``HANDLERS``), and a result's path to its check (``on_result``; the check's outcome is
``verdicts``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from common.errors import ErrorCode
from common.messages import Ack, Bye, Error, Heartbeat, Pause, Received, Result, Resume
from coordinator.pool.core_api import CoreApi
from coordinator.pool.effects import Check, CloseCode, Effects, Send
from coordinator.pool.workers import Worker, WorkerState

log = logging.getLogger("cleave.coordinator")


def on_result(
    core: CoreApi,
    worker: Worker,
    msg: Result,
    result: Received | None,
    up_bytes: int,
    effects: Effects,
) -> None:
    if msg.tile_id in worker.verifying:
        core.counters.duplicates += 1  # the same result again: one check is enough
        return
    worker.last_result_at = core.now
    tile = core.tiles.get(msg.tile_id)
    if tile is None:
        # Done already (a slower copy, or a result after a cancel): nothing to do.
        core.counters.duplicates += 1
        return
    if msg.tile_id not in core.scheduler.in_flight(worker.worker_id):
        core.counters.not_assigned += 1
        effects.send(
            worker.worker_id,
            Error(ErrorCode.NOT_ASSIGNED, "result for a tile not assigned to you", msg.tile_id),
        )
        return
    # Checked off the event loop, so this connection's next frames (heartbeats among
    # them) are read while the check runs.
    worker.verifying.add(msg.tile_id)
    effects.checks.append(
        Check(worker.worker_id, msg.tile_id, tile, result, up_bytes, max(0.0, msg.compute_s))
    )


def on_heartbeat(core: CoreApi, worker: Worker, msg: Heartbeat, effects: Effects) -> None:
    worker.state, worker.reason = WorkerState(msg.state), msg.reason
    credit = core.ledger.get(worker.key)
    effects.send(worker.worker_id, Ack(msg.seq, credit.tiles, round(credit.gflop, 6)))
    core.tell_job_state(worker, effects)


def on_pause(core: CoreApi, worker: Worker, msg: Pause, effects: Effects) -> None:
    worker.state, worker.reason = WorkerState.PAUSED, msg.reason
    requeued = core.scheduler.set_paused(worker.worker_id, True, core.now)
    core.pool_changed()
    log.info(
        "worker %s paused (%s); %d tiles move elsewhere", worker.name, msg.reason, len(requeued)
    )
    effects.workers_changed = True
    core.dispatch(effects)


def on_resume(core: CoreApi, worker: Worker, msg: Resume, effects: Effects) -> None:
    worker.state, worker.reason = WorkerState.WORKING, ""
    core.scheduler.set_paused(worker.worker_id, False, core.now)
    core.pool_changed()
    effects.workers_changed = True
    core.dispatch(effects)


def on_bye(core: CoreApi, worker: Worker, msg: Bye, effects: Effects) -> None:
    log.info("worker %s is leaving: %s", worker.name, msg.reason or "no reason given")
    core.drop(worker, CloseCode.NORMAL, "bye", effects)


def on_error(core: CoreApi, worker: Worker, msg: Error, effects: Effects) -> None:
    held = msg.tile_id in core.scheduler.in_flight(worker.worker_id)
    tile = core.tiles.get(msg.tile_id)
    if msg.code == ErrorCode.MISSING_BLOCK and tile is not None and held:
        # Its cache and our mirror of it disagree (it dropped the tile that would
        # have cached a block, say). It emptied its cache; so do we, and resend whole.
        log.info("worker %s lacks an operand block of %s: resending", worker.who, msg.tile_id)
        worker.blocks.clear()
        frame = worker.task_frame(tile, core.key)
        effects.sends.append(Send(worker.worker_id, frame, tile.tile_id))
        worker.sent_bytes[tile.tile_id] = worker.sent_bytes.get(tile.tile_id, 0) + len(frame)
        core.counters.bytes_down += len(frame)
        return
    if msg.tile_id and held:
        worker.refused += 1
        core.counters.refused += 1
        log.warning(
            "worker %s refused tile %s: %s: %s", worker.name, msg.tile_id, msg.code, msg.message
        )
        worker.sent_at.pop(msg.tile_id, None)
        core.scheduler.reject(
            worker.worker_id, msg.tile_id, core.now, reason=f"refused: {msg.code}"
        )
        core.dispatch(effects)
        core.rescue_stranded(effects)
    else:
        log.warning("worker %s reported %s: %s", worker.name, msg.code, msg.message)


HANDLERS: dict[type, Callable[[CoreApi, Worker, Any, Effects], None]] = {
    Heartbeat: on_heartbeat,
    Error: on_error,
    Pause: on_pause,
    Resume: on_resume,
    Bye: on_bye,
}
