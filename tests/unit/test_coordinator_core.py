"""CoordinatorCore without sockets: inputs with an injected time, exact effects out.

Tiles are real (``TiledGemm.iter_tiles``: signed frames, content block ids), results are
real products checked by the real Freivalds check, so a verdict here is the server's.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from support.memory_pool import PROFILE, wire_bytes

from common import PROTOCOL_VERSION
from common.batches import batch_frame
from common.errors import ErrorCode
from common.frames import encode_frame
from common.messages import (
    Ack,
    Bye,
    Cancel,
    DeviceProfile,
    Error,
    Heartbeat,
    Hello,
    JobState,
    Message,
    Pause,
    Result,
    Resume,
    Task,
    encode_message,
    parse_message,
    sign_job_state,
)
from common.signing import generate_private_key, public_key_hex
from coordinator.plan.estimates import DeviceEstimate
from coordinator.plan.planner import GemmShape, PlanConfig, plan_gemm
from coordinator.pool import core as core_module
from coordinator.pool import status as status_module
from coordinator.pool.core import MIN_PLANNING_MEMORY_CAP, CoordinatorCore, CoreConfig
from coordinator.pool.effects import Check, CloseCode, Effects
from coordinator.pool.ledger import Ledger
from coordinator.pool.workers import PoolView, WorkerState
from coordinator.schedule.scheduler import SchedulerConfig
from coordinator.serve.checks import Checker
from coordinator.tiles.tiled_gemm import SignedTile, TiledGemm

PLAN = PlanConfig(min_offload_flops=1, min_tile_flops=1, target_tiles=4)


class Harness:
    def __init__(self, tmp_path: Path, **config: Any) -> None:
        self.ledger = Ledger(tmp_path / "ledger.sqlite")
        self.key = generate_private_key()
        # A tile a window slot, as the rules below are written (shared slots: their own test).
        config.setdefault("scheduler", SchedulerConfig())
        self.core = CoordinatorCore(key=self.key, ledger=self.ledger, config=CoreConfig(**config))
        self.now = 100.0
        self.delivered: list[str] = []
        self._checker = Checker()

    def admit(
        self,
        name: str,
        *,
        window: int = 1,
        cache_bytes: int = 0,
        profile: DeviceProfile = PROFILE,
        key: Ed25519PrivateKey | None = None,
    ) -> tuple[str, Effects]:
        hello = Hello(
            name=name,
            profile=profile,
            window=window,
            worker_key=public_key_hex(key or generate_private_key()),
            cache_bytes=cache_bytes,
        )
        assert self.core.refusal(hello) == ""
        worker_id = self.core.next_worker_id()
        return worker_id, self.core.admit(worker_id, hello, self.now)

    def gemm(
        self, gemm_id: str = "g", shape: tuple[int, int, int] = (32, 16, 24), owner: str = ""
    ) -> list[SignedTile]:
        """A GEMM's tiles (``owner``: the worker the planner placed every one of them on)."""
        m, k, n = shape
        gen = torch.Generator().manual_seed(len(gemm_id))
        a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
        plan = plan_gemm(GemmShape("mm", 1, m, n, k, 4), PLAN)
        assert plan is not None
        owners = {region.index: owner for region in plan.tiles} if owner else None
        tiled = TiledGemm(gemm_id, plan, a, b, lambda out: None, owners=owners)
        return list(tiled.iter_tiles(self.key))

    def receive(self, worker_id: str, msg: Message, tensors: Any = None) -> Effects:
        return self.core.receive(worker_id, encode_message(msg, tensors), self.now)

    def beat(self, *worker_ids: str) -> None:
        """Each of these workers sends a heartbeat now: alive, whatever it holds."""
        for worker_id in worker_ids:
            self.receive(worker_id, Heartbeat(1, "working", 0))

    def result(self, worker_id: str, job: SignedTile, *, wrong: bool = False) -> Effects:
        a, b = job.matrices()
        c = a @ b
        if wrong:
            c[0, 0] += 100.0 * (1.0 + float(c.abs().max()))
        return self.receive(worker_id, Result(job.tile_id, compute_s=0.01), [("c", c)])

    def check(self, effects: Effects) -> Effects:
        """Run the checks the effects ask for, as the server's verify thread would."""
        out = Effects()
        for check in effects.checks:
            outcome = self._checker.run(check)
            if outcome.result is not None and outcome.result.ok:
                self.delivered.append(check.tile_id)
            _merge(out, self.core.checked(check, outcome, self.now))
        return out

    def complete(self, worker_id: str, job: SignedTile, *, wrong: bool = False) -> Effects:
        returned = self.result(worker_id, job, wrong=wrong)
        assert len(returned.checks) == 1, returned
        return self.check(returned)


def _merge(into: Effects, more: Effects) -> None:
    into.sends += more.sends
    into.closes += more.closes
    into.checks += more.checks
    into.compute_here += more.compute_here
    into.workers_changed |= more.workers_changed


def messages(effects: Effects, worker_id: str) -> list[Message]:
    return [parse_message(wire_bytes(s)).message for s in effects.sends if s.worker_id == worker_id]


def tasks(effects: Effects, worker_id: str) -> list[str]:
    return [m.tile_id for m in messages(effects, worker_id) if isinstance(m, Task)]


def closes(effects: Effects) -> list[tuple[str, CloseCode, str]]:
    return [(c.worker_id, c.code, c.reason) for c in effects.closes]


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    return Harness(tmp_path)


# ---- joining and work in -----------------------------------------------------------------


def test_a_worker_that_joins_gets_as_many_queued_tiles_as_its_window(h: Harness) -> None:
    jobs = h.gemm()
    assert len(jobs) >= 4
    assert h.core.submit(jobs, h.now).sends == []  # nobody to send to yet
    w1, effects = h.admit("one", window=3)
    assert tasks(effects, w1) == [job.tile_id for job in jobs[:3]]
    assert effects.workers_changed
    assert h.core.pool.workers == h.core.pool.active == 1
    assert h.core.counters.tiles_sent == 3
    assert h.core.counters.bytes_down == sum(len(job.bundle) for job in jobs[:3])


def test_submitted_tiles_go_out_to_the_free_workers_at_once(h: Harness) -> None:
    w1, _ = h.admit("one")
    w2, _ = h.admit("two")
    jobs = h.gemm()
    effects = h.core.submit(jobs, h.now)
    assert tasks(effects, w1) == [jobs[0].tile_id]
    assert tasks(effects, w2) == [jobs[1].tile_id]


def test_a_banned_key_is_refused_with_the_reason(h: Harness) -> None:
    key = generate_private_key()
    h.ledger.reject(
        public_key_hex(key), name="x", reputation=0.1, banned_reason="wrong results", now=1.0
    )
    hello = Hello(name="x", profile=PROFILE, window=1, worker_key=public_key_hex(key))
    assert "banned: wrong results" in h.core.refusal(hello)


def test_memory_caps_below_the_planning_floor_do_not_shrink_the_pool_cap(h: Harness) -> None:
    h.admit("big", profile=replace(PROFILE, mem_cap_bytes=64 << 20))
    h.admit("tiny", profile=replace(PROFILE, mem_cap_bytes=MIN_PLANNING_MEMORY_CAP - 1))
    assert h.core.pool.memory_cap == 64 << 20
    h.admit("mid", profile=replace(PROFILE, mem_cap_bytes=32 << 20))
    assert h.core.pool.memory_cap == 32 << 20
    assert len(h.core.pool.estimates) == 3


def test_joins_leaves_and_pauses_before_a_read_of_the_pool_cost_one_pass_over_it(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each pass reads every worker: a thousand workers reconnecting at once, one pass
    # each, cost the event loop a pass over each of them a thousand times.
    built: list[PoolView] = []

    def counted(**fields: Any) -> PoolView:
        built.append(PoolView(**fields))
        return built[-1]

    monkeypatch.setattr(core_module, "PoolView", counted)
    ids = [h.admit(f"w{i}", window=2)[0] for i in range(30)]
    h.receive(ids[0], Pause("computer in use"))
    h.core.disconnected(ids[1], h.now)
    assert (h.core.pool.workers, h.core.pool.active) == (29, 28)
    assert len(built) == 1
    assert h.core.pool is built[0]  # and none more until something changes
    h.receive(ids[0], Resume())
    assert (h.core.pool.workers, h.core.pool.active) == (29, 29)
    assert len(built) == 2


# ---- results -------------------------------------------------------------------------------


def test_a_verified_result_is_credited_delivered_and_the_next_tile_sent(h: Harness) -> None:
    w1, _ = h.admit("one")
    jobs = h.gemm()
    h.core.submit(jobs, h.now)
    h.now += 0.5
    returned = h.result(w1, jobs[0])
    assert returned.sends == [] and [c.tile_id for c in returned.checks] == [jobs[0].tile_id]
    assert h.core.workers[w1].verifying == {jobs[0].tile_id}
    done = h.check(returned)
    assert h.delivered == [jobs[0].tile_id]
    assert tasks(done, w1) == [jobs[1].tile_id]
    row = h.ledger.get(h.core.workers[w1].key)
    assert (row.tiles, row.flops) == (1, jobs[0].flops)
    assert row.compute_s == pytest.approx(0.01)  # what it claimed, under what it held
    assert row.bytes_down == len(jobs[0].bundle)
    assert h.core.counters.tiles_verified == 1
    assert h.core.counters.compute_s == pytest.approx(0.01)
    assert h.core.workers[w1].verifying == set()


def test_claimed_compute_time_is_credited_no_higher_than_the_time_held(h: Harness) -> None:
    w1, _ = h.admit("one")
    jobs = h.gemm()
    h.core.submit(jobs, h.now)
    h.now += 0.002
    a, b = jobs[0].matrices()
    returned = h.receive(w1, Result(jobs[0].tile_id, compute_s=50.0), [("c", a @ b)])
    h.check(returned)
    assert h.ledger.get(h.core.workers[w1].key).compute_s == pytest.approx(0.002)
    assert h.core.counters.compute_s == pytest.approx(0.002)  # the step's worker GEMM time


def test_the_same_result_twice_while_it_is_checked_is_checked_once(h: Harness) -> None:
    w1, _ = h.admit("one")
    jobs = h.gemm()
    h.core.submit(jobs, h.now)
    first = h.result(w1, jobs[0])
    again = h.result(w1, jobs[0])
    assert len(first.checks) == 1 and again.checks == [] and again.sends == []
    assert h.core.counters.duplicates == 1


def test_a_result_for_a_tile_held_by_another_worker_is_refused(h: Harness) -> None:
    w1, _ = h.admit("one")
    w2, _ = h.admit("two")
    jobs = h.gemm()
    h.core.submit(jobs, h.now)
    effects = h.result(w2, jobs[0])  # jobs[0] went to w1
    assert effects.checks == []
    [error] = messages(effects, w2)
    assert isinstance(error, Error) and error.code == "not_assigned"
    assert error.tile_id == jobs[0].tile_id
    assert h.core.counters.not_assigned == 1


def test_a_result_for_a_finished_tile_counts_as_a_duplicate(h: Harness) -> None:
    w1, _ = h.admit("one")
    jobs = h.gemm()
    h.core.submit(jobs, h.now)
    h.complete(w1, jobs[0])
    effects = h.result(w1, jobs[0])
    assert effects.checks == [] and effects.sends == []
    assert h.core.counters.duplicates == 1


def test_an_undecodable_result_is_answered_and_fails_its_check(h: Harness) -> None:
    w1, _ = h.admit("one")
    w2, _ = h.admit("two")
    jobs = h.gemm()
    h.core.submit(jobs[:2], h.now)  # one each: the other worker is free after its own
    header = {
        "type": "result",
        "v": PROTOCOL_VERSION,
        "tile_id": jobs[0].tile_id,
        "compute_s": 0.01,
        # A shape its bytes cannot fill: the frame parses, the tensor does not decode.
        "tensors": [{"dtype": "float32", "name": "c", "nbytes": 16, "offset": 0, "shape": [3, 3]}],
    }
    bad = h.core.receive(w1, encode_frame(header, [bytes(16)]), h.now)
    assert messages(bad, w1) == [] and len(bad.checks) == 1  # decoded with the check
    h.complete(w2, jobs[1])  # w2 is free again when the failed tile is re-issued
    failed = h.check(bad)
    error, verdict = messages(failed, w1)
    assert isinstance(error, Error) and error.tile_id == jobs[0].tile_id
    assert error.code == "bad_tensor" and "[3, 3]" in error.message
    assert isinstance(verdict, Error) and verdict.code == "failed_check"
    assert jobs[0].tile_id in tasks(failed, w2)
    assert h.delivered == [jobs[1].tile_id]
    assert h.core.counters.rejected == 1


def test_a_wrong_result_costs_reputation_and_its_tile_goes_to_another_worker(
    h: Harness,
) -> None:
    w1, _ = h.admit("cheat")
    w2, _ = h.admit("honest")
    jobs = h.gemm()
    h.core.submit(jobs[:2], h.now)  # one each: the other worker is free after its own
    h.complete(w2, jobs[1])
    effects = h.complete(w1, jobs[0], wrong=True)
    verdict = messages(effects, w1)[0]
    assert isinstance(verdict, Error) and verdict.code == "failed_check"
    assert "reputation now 0.50" in verdict.message
    assert tasks(effects, w2) == [jobs[0].tile_id]  # re-issued to the other worker
    assert h.delivered == [jobs[1].tile_id]
    assert h.ledger.get(h.core.workers[w1].key).rejected == 1
    assert h.core.scheduler.stats.reissued >= 1


def test_three_wrong_results_ban_the_key_on_every_connection_it_has(h: Harness) -> None:
    cheat_key = generate_private_key()
    w1, _ = h.admit("cheat-a", key=cheat_key)
    w2, _ = h.admit("cheat-b", key=cheat_key)
    w3, _ = h.admit("honest")
    effects = Effects()
    for round_ in range(3):
        jobs = h.gemm(f"g{round_}")
        h.core.submit(jobs, h.now)
        cheat = w1 if round_ % 2 == 0 else w2
        [held] = h.core.scheduler.in_flight(cheat)
        job = next(j for j in jobs if j.tile_id == held)
        _merge(effects, h.complete(cheat, job, wrong=True))
        h.core.kept_here(f"g{round_}", 0, finished=True, now=h.now)  # done with this GEMM
    assert h.core.counters.banned == 1
    assert sorted(closes(effects)) == [
        (w1, CloseCode.POLICY, f"banned: {_ban_reason(h, cheat_key)}"),
        (w2, CloseCode.POLICY, f"banned: {_ban_reason(h, cheat_key)}"),
    ]
    for worker_id in (w1, w2):
        said = messages(effects, worker_id)
        assert any(isinstance(m, Error) and m.code == "banned" for m in said)
    assert set(h.core.workers) == {w3}
    hello = Hello(name="again", profile=PROFILE, window=1, worker_key=public_key_hex(cheat_key))
    assert "is banned" in h.core.refusal(hello)


def _ban_reason(h: Harness, key: Ed25519PrivateKey) -> str:
    return h.ledger.get(public_key_hex(key)).banned_reason


def test_a_verdict_on_a_worker_that_left_meanwhile_earns_it_nothing(h: Harness) -> None:
    w1, _ = h.admit("one")
    jobs = h.gemm()
    h.core.submit(jobs, h.now)
    returned = h.result(w1, jobs[0])
    h.core.disconnected(w1, h.now)
    w2, joined = h.admit("two")
    assert jobs[0].tile_id in tasks(joined, w2)  # re-issued
    # The check placed the verified tile, but its worker is gone: no credit, and the
    # re-issued copy is called back, so that nobody is credited for an unused tile.
    done = h.check(returned)
    assert h.delivered == [jobs[0].tile_id]
    assert messages(done, w2) == [Cancel(jobs[0].tile_id)]
    assert h.result(w2, jobs[0]).checks == []  # too late: nothing to check or credit
    assert h.ledger.all() == []
    # One for the verdict on the worker that left, one for the copy that came too late.
    assert h.core.counters.duplicates == 2 and h.core.counters.tiles_verified == 0


# ---- worker messages --------------------------------------------------------------------------


def test_a_heartbeat_is_answered_with_the_credit_the_ledger_holds(h: Harness) -> None:
    w1, _ = h.admit("one")
    jobs = h.gemm()
    h.core.submit(jobs, h.now)
    h.complete(w1, jobs[0])
    effects = h.receive(w1, Heartbeat(seq=7, state="idle", in_flight=1, reason="owner busy"))
    assert messages(effects, w1) == [Ack(7, 1, round(jobs[0].flops / 1e9, 6))]
    assert h.core.workers[w1].state is WorkerState.IDLE
    assert h.core.workers[w1].reason == "owner busy"


def test_a_pause_hands_the_tiles_to_another_worker_and_resume_takes_work_again(
    h: Harness,
) -> None:
    w1, _ = h.admit("one", window=2)
    jobs = h.gemm()
    h.core.submit(jobs, h.now)
    held = sorted(h.core.scheduler.in_flight(w1))
    w2, joined = h.admit("two", window=2)
    assert tasks(joined, w2) == [jobs[2].tile_id, jobs[3].tile_id]
    paused = h.receive(w1, Pause("computer in use"))
    assert paused.workers_changed and h.core.pool.active == 1
    # The planner plans for the workers that take tiles: not the paused one.
    assert [e.worker_id for e in h.core.pool.estimates] == [w2]
    assert h.core.scheduler.in_flight(w1) == frozenset()
    shown = next(w for w in h.core.status(h.now)["workers"] if w["id"] == w1)
    assert (shown["state"], shown["reason"], shown["in_flight"]) == ("paused", "computer in use", 0)
    given = tasks(h.complete(w2, jobs[2]), w2) + tasks(h.complete(w2, jobs[3]), w2)
    assert sorted(given) == held  # the paused worker's tiles
    resumed = h.receive(w1, Resume())
    assert resumed.workers_changed and h.core.pool.active == 2
    assert sorted(e.worker_id for e in h.core.pool.estimates) == sorted([w1, w2])
    assert h.core.workers[w1].state is WorkerState.WORKING


def test_bye_closes_normally_and_moves_the_tiles_on(h: Harness) -> None:
    w1, _ = h.admit("one")
    w2, _ = h.admit("two")
    jobs = h.gemm()
    h.core.submit(jobs[:2], h.now)  # one each: the other worker is free after its own
    h.complete(w2, jobs[1])
    effects = h.receive(w1, Bye("shutting down"))
    assert closes(effects) == [(w1, CloseCode.NORMAL, "bye")]
    assert w1 not in h.core.workers
    assert tasks(effects, w2) == [jobs[0].tile_id]


def test_a_refused_tile_goes_to_another_worker(h: Harness) -> None:
    w1, _ = h.admit("one")
    w2, _ = h.admit("two")
    jobs = h.gemm()
    h.core.submit(jobs[:2], h.now)  # one each: the other worker is free after its own
    h.complete(w2, jobs[1])
    effects = h.receive(w1, Error("bad_signature", "no", jobs[0].tile_id))
    assert h.core.counters.refused == 1 and h.core.workers[w1].refused == 1
    assert jobs[0].tile_id not in h.core.scheduler.in_flight(w1)
    assert tasks(effects, w2) == [jobs[0].tile_id]


def test_a_tile_every_worker_refuses_is_computed_here(h: Harness) -> None:
    w1, _ = h.admit("only")
    jobs = h.gemm()
    h.core.submit(jobs, h.now)
    effects = h.receive(w1, Error("bad_signature", "no", jobs[0].tile_id))
    assert [job.tile_id for job in effects.compute_here] == [jobs[0].tile_id]
    assert h.core.counters.computed_here == 1
    assert h.core.counters.flops_computed_here == jobs[0].flops
    assert jobs[0].tile_id not in h.core.tiles


def test_a_tile_over_every_workers_memory_cap_is_computed_here(h: Harness) -> None:
    jobs = h.gemm()
    h.core.submit(jobs, h.now)
    w1, joined = h.admit("tiny", profile=replace(PROFILE, mem_cap_bytes=1))
    assert joined.sends == [] and joined.compute_here == []
    effects = h.core.tick(h.now)
    assert [job.tile_id for job in effects.compute_here] == [job.tile_id for job in jobs]
    assert h.core.counters.tiles_sent == 0 and h.core.tiles == {}


def test_an_error_without_a_tile_changes_nothing(h: Harness) -> None:
    w1, _ = h.admit("one")
    effects = h.receive(w1, Error("gpu", "driver restarted"))
    assert effects == Effects()


def test_a_message_only_the_coordinator_sends_gets_an_error_and_the_link_stays(
    h: Harness,
) -> None:
    w1, _ = h.admit("one")
    effects = h.receive(w1, Cancel("x"))
    [error] = messages(effects, w1)
    assert isinstance(error, Error) and error.code == ErrorCode.UNEXPECTED_MESSAGE
    assert effects.closes == [] and w1 in h.core.workers


# ---- hostile frames ---------------------------------------------------------------------------


def test_a_text_frame_closes_the_connection_and_its_tiles_move_on(h: Harness) -> None:
    w1, _ = h.admit("one")
    w2, _ = h.admit("two")
    jobs = h.gemm()
    h.core.submit(jobs[:2], h.now)  # one each: the other worker is free after its own
    h.complete(w2, jobs[1])
    effects = h.core.receive(w1, "hello?", h.now)
    assert closes(effects) == [(w1, CloseCode.POLICY, "text frames are not part of the protocol")]
    assert effects.workers_changed and w1 not in h.core.workers
    assert tasks(effects, w2) == [jobs[0].tile_id]


def test_a_malformed_frame_is_answered_then_closed(h: Harness) -> None:
    w1, _ = h.admit("one")
    effects = h.core.receive(w1, b"\x00garbage", h.now)
    [error] = messages(effects, w1)
    assert isinstance(error, Error)
    [(worker_id, code, _)] = closes(effects)
    assert (worker_id, code) == (w1, CloseCode.POLICY)


@pytest.mark.parametrize(
    ("header", "code"),
    [
        ({"type": "bogus", "v": PROTOCOL_VERSION}, ErrorCode.UNKNOWN_TYPE),
        ({"type": "heartbeat", "v": PROTOCOL_VERSION + 41}, ErrorCode.VERSION),
        (
            {"type": "heartbeat", "v": PROTOCOL_VERSION, "seq": 1, "state": "x"},
            ErrorCode.BAD_MESSAGE,
        ),
    ],
)
def test_a_well_framed_message_it_cannot_use_gets_an_error_and_the_link_stays(
    h: Harness, header: dict[str, Any], code: str
) -> None:
    w1, _ = h.admit("one")
    effects = h.core.receive(w1, encode_frame(header), h.now)
    [error] = messages(effects, w1)
    assert isinstance(error, Error) and error.code == code, error
    assert effects.closes == [] and w1 in h.core.workers
    # Still served: a heartbeat gets its Ack.
    assert messages(h.receive(w1, Heartbeat(5, "idle", 0)), w1) == [Ack(5, 0, 0.0)]


def test_a_message_flood_closes_the_connection_and_spaced_messages_do_not(
    tmp_path: Path,
) -> None:
    h = Harness(tmp_path, max_messages_per_s=10.0, message_burst=3)
    w1, _ = h.admit("steady")
    for _ in range(30):  # ten a second: within the rate, with the injected clock
        h.now += 0.1
        assert h.receive(w1, Heartbeat(1, "working", 0)).closes == []
    w2, _ = h.admit("flood")
    effects = Effects()
    for _ in range(4):  # at one instant: one over the burst
        _merge(effects, h.receive(w2, Heartbeat(1, "working", 0)))
    [(worker_id, code, reason)] = closes(effects)
    assert (worker_id, code) == (w2, CloseCode.POLICY) and "max_messages_per_s=10" in reason
    assert isinstance(messages(effects, w2)[-1], Error)
    assert set(h.core.workers) == {w1}


def test_a_frame_from_a_forgotten_worker_closes_its_connection(h: Harness) -> None:
    w1, _ = h.admit("one")
    h.core.disconnected(w1, h.now)
    effects = h.receive(w1, Heartbeat(1, "working", 0))
    assert closes(effects) == [(w1, CloseCode.TIMEOUT, "heartbeat timeout")]


# ---- time --------------------------------------------------------------------------------------


def test_a_worker_that_misses_its_heartbeats_is_dropped_at_the_tick_after_the_timeout(
    tmp_path: Path,
) -> None:
    h = Harness(tmp_path, scheduler=SchedulerConfig(heartbeat_timeout_s=5.0))
    w1, _ = h.admit("silent")
    w2, _ = h.admit("alive")
    jobs = h.gemm()
    h.core.submit(jobs[:2], h.now)  # one each: the other worker is free after its own
    h.complete(w2, jobs[1])
    h.now += 4.9
    h.beat(w2)
    assert h.core.tick(h.now).closes == []
    h.now += 0.2
    effects = h.core.tick(h.now)
    assert closes(effects) == [(w1, CloseCode.TIMEOUT, "heartbeat timeout")]
    assert tasks(effects, w2) == [jobs[0].tile_id]


def copied_to_an_idle_worker(tmp_path: Path) -> tuple[Harness, str, str, list[SignedTile]]:
    """A tile that worker "sitter" holds too long, copied to worker "idle"."""
    h = Harness(tmp_path, scheduler=SchedulerConfig(speculate_after=2.0))
    w1, _ = h.admit("sitter")
    jobs = h.gemm()
    h.core.submit(jobs[:1], h.now)
    w2, joined = h.admit("idle")
    assert joined.sends == []
    h.now += 8.0  # far past any estimate of the tile; both still heartbeat
    h.beat(w1, w2)
    effects = h.core.tick(h.now)
    assert tasks(effects, w2) == [jobs[0].tile_id]
    assert h.core.counters.speculated == 1
    return h, w1, w2, jobs


def test_a_tile_sat_on_is_copied_to_an_idle_worker_and_the_first_result_cancels_the_other(
    tmp_path: Path,
) -> None:
    h, w1, w2, jobs = copied_to_an_idle_worker(tmp_path)
    done = h.complete(w2, jobs[0])
    assert [m for m in messages(done, w1) if isinstance(m, Cancel)] == [Cancel(jobs[0].tile_id)]
    late = h.result(w1, jobs[0])
    assert late.checks == [] and h.core.counters.duplicates == 1


def test_a_straggler_past_its_deadline_is_copied_cancelled_and_its_late_result_ignored(
    tmp_path: Path,
) -> None:
    h = Harness(tmp_path, scheduler=SchedulerConfig(tile_timeout_s=5.0))
    slow, _ = h.admit("slow")
    jobs = h.gemm()
    h.core.submit(jobs[:1], h.now)
    quick, _ = h.admit("quick")
    h.now += 4.9
    h.beat(slow, quick)  # both alive: the slow one is just slow
    assert tasks(h.core.tick(h.now), quick) == []
    h.now += 0.2
    h.beat(slow, quick)
    assert tasks(h.core.tick(h.now), quick) == [jobs[0].tile_id]  # past its deadline
    done = h.complete(quick, jobs[0])
    assert [m for m in messages(done, slow) if isinstance(m, Cancel)] == [Cancel(jobs[0].tile_id)]
    late = h.result(slow, jobs[0])
    assert late.checks == [] and late.sends == [] and h.core.counters.duplicates == 1
    assert h.ledger.get(h.core.workers[slow].key).tiles == 0
    assert h.core.scheduler.stats.reissued == 1


def test_a_copys_result_checked_after_the_tile_is_in_is_neither_credited_nor_failed(
    tmp_path: Path,
) -> None:
    """Both copies' results arrived before either was checked. By the time the second is
    checked, its tile is in and the step may have changed the operands (the blocks are
    views of the GEMM's inputs): it is not checked at all."""
    h, w1, w2, jobs = copied_to_an_idle_worker(tmp_path)
    first, second = h.result(w2, jobs[0]), h.result(w1, jobs[0], wrong=True)
    assert len(first.checks) == len(second.checks) == 1
    h.check(first)
    jobs[0].a.add_(1.0)  # the step goes on
    said = h.check(second)
    assert messages(said, w1) == []
    sitter = h.ledger.get(h.core.workers[w1].key)
    assert sitter.rejected == 0 and sitter.tiles == 0 and sitter.reputation == 1.0
    assert h.core.counters.rejected == 0 and h.core.counters.duplicates == 1
    assert h.delivered == [jobs[0].tile_id]


def test_the_first_of_several_tiles_sent_together_measures_the_links(h: Harness) -> None:
    jobs = h.gemm()
    h.core.submit(jobs, h.now)
    w1, joined = h.admit("one", window=2)
    assert len(tasks(joined, w1)) == 2
    h.now += 0.5
    h.complete(w1, jobs[0])
    estimate = h.core.workers[w1].estimate
    assert estimate is not None and estimate.link_samples == 1
    assert estimate.down_bps < h.core.config.link_guess_bytes_per_s  # 0.5 s for a few KB
    h.now += 0.5
    h.complete(w1, jobs[1])  # it waited behind the first: compute only
    assert h.core.workers[w1].estimate.link_samples == 1  # type: ignore[union-attr]


def test_a_slow_worker_does_not_steal_tiles_planned_for_a_much_faster_one(h: Harness) -> None:
    fast, _ = h.admit("fast", window=2)
    slow, _ = h.admit("slow", window=2)
    for worker_id, flops in ((fast, 1e12), (slow, 1e6)):
        h.core.set_estimate(worker_id, DeviceEstimate(worker_id, flops, 1e15, 1e15, None, h.now, 1))
    jobs = h.gemm(owner=fast)
    effects = h.core.submit(jobs, h.now)
    # The fast one returns all four before the slow one would return one.
    assert tasks(effects, fast) == [job.tile_id for job in jobs[:2]]
    assert tasks(effects, slow) == []


def test_the_predicted_finish_counts_the_tiles_sent_before_it(h: Harness) -> None:
    w1, _ = h.admit("one", window=2)
    jobs = h.gemm()
    start = h.now
    h.core.submit(jobs[:1], h.now)
    h.now += 1e-6
    h.core.submit(jobs[1:2], h.now)
    first, second = (h.core.predict.finish_at(w1, job.tile_id) for job in jobs[:2])
    run = [h.core.predict.run_time(w1, job.ticket) for job in jobs[:2]]
    assert first == pytest.approx(start + run[0])
    assert second == pytest.approx(h.now + run[0] + run[1])  # it waits behind the first


def test_a_finished_gemm_cancels_what_workers_still_hold_of_it(h: Harness) -> None:
    w1, _ = h.admit("one", window=4)
    jobs = h.gemm()
    h.core.submit(jobs, h.now)
    effects = h.core.kept_here("g", tiles=2, finished=True, now=h.now)
    assert [m for m in messages(effects, w1) if isinstance(m, Cancel)] == [
        Cancel(job.tile_id) for job in jobs[:4]
    ]
    assert h.core.counters.kept_here == 2


def test_the_check_that_completes_a_gemm_credits_its_tile_then_cancels_the_copies(
    tmp_path: Path,
) -> None:
    h = Harness(tmp_path, scheduler=SchedulerConfig(speculate_after=2.0))
    w1, _ = h.admit("one", window=8)
    jobs = h.gemm()
    h.core.submit(jobs, h.now)
    for job in jobs[1:]:
        h.complete(w1, job)
    w2, _ = h.admit("idle")
    h.now += 8.0  # the last tile sits: an idle worker gets a copy
    h.beat(w1, w2)
    assert tasks(h.core.tick(h.now), w2) == [jobs[0].tile_id]
    done = h.complete(w1, jobs[0])  # placed on the check's visit: the GEMM is whole
    assert h.ledger.get(h.core.workers[w1].key).tiles == len(jobs)
    assert [m for m in messages(done, w2) if isinstance(m, Cancel)] == [Cancel(jobs[0].tile_id)]
    assert h.core.counters.tiles_verified == len(jobs) and h.core.counters.duplicates == 0


# ---- the operand cache mirror ------------------------------------------------------------------


def test_a_worker_with_a_cache_is_sent_a_block_it_holds_by_reference(h: Harness) -> None:
    w1, _ = h.admit("cached", window=1, cache_bytes=1 << 20)
    jobs = h.gemm()
    h.core.submit(jobs, h.now)
    shares = [j for j in jobs[1:] if set(j.blocks) & set(jobs[0].blocks)]
    assert shares, "the grid has tiles that share an operand block"
    sent = h.complete(w1, jobs[0])
    [frame] = [s for s in sent.sends if s.tile_id]
    assert frame.tile_id in {j.tile_id for j in shares}  # affinity: it holds a block
    job = next(j for j in jobs if j.tile_id == frame.tile_id)
    assert len(frame.data) < len(job.bundle)
    counters = h.core.counters
    assert counters.bytes_down < counters.bytes_down_uncached


def test_a_worker_missing_a_cached_block_gets_the_tile_whole(h: Harness) -> None:
    w1, _ = h.admit("cached", window=1, cache_bytes=1 << 20)
    jobs = h.gemm()
    h.core.submit(jobs, h.now)
    sent = h.complete(w1, jobs[0])
    [frame] = [s for s in sent.sends if s.tile_id]
    effects = h.receive(w1, Error("missing_block", "evicted", frame.tile_id))
    [again] = effects.sends
    task = parse_message(wire_bytes(again))
    assert isinstance(task.message, Task) and task.message.tile_id == frame.tile_id
    assert len(again.data) > len(frame.data)  # both operands inline this time
    assert len(h.core.workers[w1].blocks) == 2  # the mirror starts over with this task


# ---- status ------------------------------------------------------------------------------------


def test_status_shows_each_worker_and_the_counters(h: Harness) -> None:
    w1, _ = h.admit("one")
    jobs = h.gemm()
    h.core.submit(jobs, h.now)
    h.now += 3.0
    h.complete(w1, jobs[0])
    status = h.core.status(h.now)
    [worker] = status["workers"]
    assert (worker["id"], worker["name"], worker["state"]) == (w1, "one", "working")
    assert worker["connected_s"] == 3.0 and worker["tiles_session"] == 1
    assert worker["in_flight"] == 1
    assert status["tiles"]["verified"] == 1 and status["tiles"]["sent"] == 2
    assert status["tiles"]["queued"] == len(jobs) - 2


def test_a_large_pool_lists_its_busiest_workers_and_top_keys_and_counts_them_all(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A page or a scrape of a pool of thousands would build a row for every worker and
    # every key ever credited, on the event loop, every second a dashboard is open.
    monkeypatch.setattr(status_module, "STATUS_ROWS", 5)
    ids = [h.admit(f"w{i}")[0] for i in range(12)]
    for busy, worker_id in enumerate(ids[3:9]):
        h.core.workers[worker_id].tiles_session = 10 + busy
    h.receive(ids[0], Pause("computer in use"))
    for i in range(8):
        h.ledger.credit(
            f"key{i}",
            name=f"k{i}",
            flops=10**9 * (i + 1),
            bytes_down=0,
            bytes_up=0,
            compute_s=1.0,
            reputation=1.0,
            now=h.now,
        )
    status = h.core.status(h.now)
    # The five with the most tiles this session, in the order they joined.
    assert [w["id"] for w in status["workers"]] == ids[4:9]
    assert status["pool"] == {"connected": 12, "active": 11, "ledger_keys": 8}
    assert [row["name"] for row in status["ledger"].values()] == ["k7", "k6", "k5", "k4", "k3"]
    monkeypatch.setattr(status_module, "STATUS_ROWS", 20)
    assert [w["id"] for w in h.core.status(h.now)["workers"]] == ids  # all, as they joined


def test_checks_carry_the_result_bytes_and_claimed_time(h: Harness) -> None:
    w1, _ = h.admit("one")
    jobs = h.gemm()
    h.core.submit(jobs, h.now)
    [check] = h.result(w1, jobs[0]).checks
    assert isinstance(check, Check)
    assert (check.worker_id, check.tile_id, check.compute_s) == (w1, jobs[0].tile_id, 0.01)
    assert check.up_bytes == jobs[0].ticket.up_bytes  # the payload: the product's bytes


def test_each_worker_is_told_the_job_state_once_per_change(h: Harness) -> None:
    w1, joined = h.admit("one")
    assert not [m for m in messages(joined, w1) if isinstance(m, JobState)]  # none yet
    first = sign_job_state(h.key, JobState(step=3, steps=10, note="waiting"))
    h.core.set_job_state(first)
    w2, joined = h.admit("two")
    assert [m for m in messages(joined, w2) if isinstance(m, JobState)] == [first]

    def told(worker_id: str) -> list[Message]:
        effects = h.receive(worker_id, Heartbeat(1, "working", 0))
        return [m for m in messages(effects, worker_id) if isinstance(m, JobState)]

    assert told(w1) == [first]  # with its next ack
    assert told(w1) == [] and told(w2) == []  # nothing new: nothing sent
    second = sign_job_state(h.key, JobState(step=4, steps=10, note=""))
    h.core.set_job_state(second)
    assert told(w1) == [second] and told(w2) == [second]
    assert told(w2) == []


# ---- batches -----------------------------------------------------------------------------------


def _result_frame(job: SignedTile) -> bytes:
    a, b = job.matrices()
    return encode_message(Result(job.tile_id, compute_s=0.01), [("c", a @ b)])


def test_each_frame_of_a_batch_is_taken_as_if_it_came_alone_in_order(h: Harness) -> None:
    w1, _ = h.admit("one", window=2)
    jobs = h.gemm()
    h.core.submit(jobs, h.now)
    batch = batch_frame(
        [_result_frame(jobs[0]), encode_message(Heartbeat(3, "working", 1)), _result_frame(jobs[1])]
    )
    effects = h.core.receive(w1, batch, h.now)
    assert [c.tile_id for c in effects.checks] == [jobs[0].tile_id, jobs[1].tile_id]
    assert messages(effects, w1) == [Ack(3, 0, 0.0)]
    done = h.check(effects)
    assert h.delivered == [jobs[0].tile_id, jobs[1].tile_id]
    assert tasks(done, w1) == [jobs[2].tile_id, jobs[3].tile_id]
    assert h.ledger.get(h.core.workers[w1].key).tiles == 2


def test_a_bye_inside_a_batch_ends_it_there(h: Harness) -> None:
    w1, _ = h.admit("one", window=2)
    jobs = h.gemm()
    h.core.submit(jobs, h.now)
    batch = batch_frame([encode_message(Bye("done")), _result_frame(jobs[0])])
    effects = h.core.receive(w1, batch, h.now)
    assert closes(effects) == [(w1, CloseCode.NORMAL, "bye")]
    assert effects.checks == [] and w1 not in h.core.workers


def test_a_bad_frame_inside_a_batch_is_answered_and_the_rest_still_taken(h: Harness) -> None:
    w1, _ = h.admit("one")
    bogus = encode_frame({"type": "bogus", "v": PROTOCOL_VERSION})
    effects = h.core.receive(
        w1, batch_frame([bogus, encode_message(Heartbeat(4, "idle", 0))]), h.now
    )
    error, ack = messages(effects, w1)
    assert isinstance(error, Error) and error.code == ErrorCode.UNKNOWN_TYPE
    assert ack == Ack(4, 0, 0.0) and effects.closes == []


@pytest.mark.parametrize(
    "inner",
    [
        pytest.param(
            lambda: batch_frame([encode_message(Heartbeat(1, "idle", 0))] * 2), id="nested"
        ),
        pytest.param(lambda: b"\x00garbage", id="malformed"),
    ],
)
def test_a_batch_holding_a_batch_or_a_broken_frame_closes_the_connection(
    h: Harness, inner: Any
) -> None:
    w1, _ = h.admit("one")
    effects = h.core.receive(
        w1, batch_frame([encode_message(Heartbeat(1, "idle", 0)), inner()]), h.now
    )
    ack, error = messages(effects, w1)
    assert ack == Ack(1, 0, 0.0) and isinstance(error, Error)
    [(worker_id, code, _)] = closes(effects)
    assert (worker_id, code) == (w1, CloseCode.POLICY) and w1 not in h.core.workers
