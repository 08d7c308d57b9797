"""The owner's policy as pure logic: idle hysteresis, schedule, snooze, battery, priority.

Every test injects its readings and its clock; nothing here sleeps or reads the machine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from client_app.config import ConfigError, WorkerSettings
from client_app.policy import (
    GPU_BUSY,
    IN_USE,
    ON_BATTERY,
    OUTSIDE_SCHEDULE,
    RUN,
    SNOOZED,
    Decision,
    IdleDetector,
    PolicyConfig,
    Readings,
    Schedule,
    Snooze,
    decide,
    decide_all,
    format_until,
)
from client_app.policy_runner import policy_config
from client_app.readings import Sampler

DAY = datetime(2024, 5, 2)  # a Thursday; naive local time unless a test says otherwise


def at(clock: str, day: datetime = DAY) -> datetime:
    parts = [int(p) for p in clock.split(":")]
    hh, mm, ss = (parts + [0])[:3]
    return day.replace(hour=hh, minute=mm, second=ss)


# ---- schedule --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "clock", "allowed"),
    [
        ("", "12:00", True),
        ("", "00:00", True),
        ("09:00-17:00", "09:00", True),  # start is inclusive
        ("09:00-17:00", "08:59:59", False),
        ("09:00-17:00", "16:59:59", True),
        ("09:00-17:00", "17:00", False),  # end is exclusive
        ("22:00-07:00", "21:59:59", False),
        ("22:00-07:00", "22:00", True),
        ("22:00-07:00", "23:59:59", True),
        ("22:00-07:00", "00:00", True),  # spans midnight
        ("22:00-07:00", "06:59:59", True),
        ("22:00-07:00", "07:00", False),
        ("22:00-07:00", "12:00", False),
        ("22:00-24:00", "23:59:59", True),
        ("22:00-24:00", "00:00", False),
        ("00:00-24:00", "00:00", True),
        ("00:00-24:00", "23:59:59", True),
        ("12:00-13:00, 22:00-07:00", "12:30", True),
        ("12:00-13:00, 22:00-07:00", "13:30", False),
        ("12:00-13:00, 22:00-07:00", "03:00", True),
        ("7:30-8:00", "07:45", True),  # one-digit hours are fine
    ],
)
def test_schedule_allows(spec: str, clock: str, allowed: bool) -> None:
    assert Schedule.parse(spec).allows(at(clock)) is allowed


@pytest.mark.parametrize(
    ("spec", "clock", "expected"),
    [
        ("22:00-07:00", "12:00", at("22:00")),
        ("22:00-07:00", "23:00", at("07:00", DAY + timedelta(days=1))),
        ("22:00-07:00", "03:00", at("07:00")),
        ("22:00-07:00", "07:00", at("22:00")),  # exactly on a boundary: the next one
        ("22:00-07:00", "22:00", at("07:00", DAY + timedelta(days=1))),
        ("09:00-17:00", "18:00", at("09:00", DAY + timedelta(days=1))),
        # Adjacent windows merge: 17:00 is not a change.
        ("09:00-17:00,17:00-18:00", "10:00", at("18:00")),
        ("22:00-24:00,00:00-07:00", "23:00", at("07:00", DAY + timedelta(days=1))),
        ("", "12:00", None),
        ("00:00-24:00", "12:00", None),
        ("00:00-12:00,12:00-24:00", "12:00", None),
    ],
)
def test_schedule_next_change(spec: str, clock: str, expected: datetime | None) -> None:
    assert Schedule.parse(spec).next_change(at(clock)) == expected


def test_schedule_next_change_keeps_the_time_zone() -> None:
    tz = timezone(timedelta(hours=2))
    now = at("12:00").replace(tzinfo=tz)
    assert Schedule.parse("22:00-07:00").next_change(now) == at("22:00").replace(tzinfo=tz)


@pytest.mark.parametrize(
    "spec",
    [
        "9-17",
        "25:00-01:00",
        "10:00-10:00",
        "10:00",
        "10:0-11:00",
        "24:00-01:00",
        "ab:cd-01:00",
        "10:00-12:60",
        "-",
        "10:00-11:00-12:00",
        "+1:00-02:00",
    ],
)
def test_schedule_rejects_malformed_windows(spec: str) -> None:
    with pytest.raises(ValueError):
        Schedule.parse(spec)


def test_schedule_ignores_empty_parts() -> None:
    assert Schedule.parse(" , 22:00-07:00 ,") == Schedule.parse("22:00-07:00")


# ---- snooze ----------------------------------------------------------------------------


def test_snooze_one_hour_reads_as_a_clock_time_and_expires() -> None:
    snooze = Snooze.for_duration(at("14:40"))
    config = PolicyConfig(snooze=snooze)
    assert decide(Readings(), at("14:40"), config) == Decision(
        False, SNOOZED, "Snoozed until 15:40", "snoozed until 15:40"
    )
    assert decide(Readings(), at("15:39:59"), config).reason_code == SNOOZED
    assert decide(Readings(), at("15:40"), config).run  # expiry is exact


def test_snooze_until_tomorrow_is_the_next_local_midnight() -> None:
    snooze = Snooze.until_tomorrow(at("23:50"))
    assert snooze.until == at("00:00", DAY + timedelta(days=1))
    assert Snooze.until_tomorrow(at("00:00")).until == snooze.until
    line = decide(Readings(), at("23:50"), PolicyConfig(snooze=snooze)).line
    assert line == "Snoozed until tomorrow 00:00"


@pytest.mark.parametrize(
    ("until", "expected"),
    [
        (at("15:40"), "15:40"),
        (at("09:05", DAY + timedelta(days=1)), "tomorrow 09:05"),
        (at("09:05", DAY + timedelta(days=3)), "2024-05-05 09:05"),
    ],
)
def test_format_until(until: datetime, expected: str) -> None:
    assert format_until(until, at("12:00")) == expected


def test_snooze_iso_round_trip() -> None:
    aware = at("15:40").replace(tzinfo=timezone(timedelta(hours=-5)))
    assert Snooze.from_iso(Snooze(aware).to_iso()) == Snooze(aware)
    assert Snooze.from_iso("") == Snooze() and Snooze().to_iso() == ""
    with pytest.raises(ValueError):
        Snooze.from_iso("tomorrow")


# ---- battery and priority --------------------------------------------------------------

SNOOZE = Snooze(at("15:40"))
NIGHT = Schedule.parse("22:00-07:00")


@pytest.mark.parametrize(
    ("config", "readings", "idle", "code", "line"),
    [
        (PolicyConfig(), Readings(), True, RUN, ""),
        (PolicyConfig(), Readings(on_battery=True), True, ON_BATTERY, "Paused: on battery"),
        (PolicyConfig(), Readings(on_battery=False), True, RUN, ""),
        (PolicyConfig(), Readings(on_battery=None), True, RUN, ""),  # no battery = mains
        (PolicyConfig(pause_on_battery=False), Readings(on_battery=True), True, RUN, ""),
        (
            PolicyConfig(schedule=NIGHT),
            Readings(),
            True,
            OUTSIDE_SCHEDULE,
            "Paused: outside schedule",
        ),
        (PolicyConfig(idle_only=True), Readings(), False, IN_USE, "Paused: computer in use"),
        (PolicyConfig(idle_only=True), Readings(), True, RUN, ""),
        (PolicyConfig(idle_only=False), Readings(), False, RUN, ""),  # idle only if asked
        # Priority: snooze > battery > schedule > in use.
        (
            PolicyConfig(idle_only=True, schedule=NIGHT, snooze=SNOOZE),
            Readings(on_battery=True),
            False,
            SNOOZED,
            "Snoozed until 15:40",
        ),
        (
            PolicyConfig(idle_only=True, schedule=NIGHT),
            Readings(on_battery=True),
            False,
            ON_BATTERY,
            "Paused: on battery",
        ),
        (
            PolicyConfig(idle_only=True, schedule=NIGHT),
            Readings(on_battery=False),
            False,
            OUTSIDE_SCHEDULE,
            "Paused: outside schedule",
        ),
    ],
)
def test_decide_priority(
    config: PolicyConfig, readings: Readings, idle: bool, code: str, line: str
) -> None:
    decision = decide(readings, at("12:00"), config, idle=idle)
    assert (decision.run, decision.reason_code, decision.line) == (code == RUN, code, line)
    # The reason the core sends is the line without its "Paused: " prefix.
    if code not in (RUN, SNOOZED):
        assert "Paused: " + decision.reason == line


# ---- idle detection --------------------------------------------------------------------

IDLE = IdleDetector(threshold=25.0, idle_after_s=60.0, margin=10.0, busy_after_s=5.0)


def run_detector(
    samples: list[tuple[float, float | None, float | None]], start: IdleDetector = IDLE
) -> list[bool]:
    """(t, other CPU %, user idle s) per sample -> the idle answer after each one."""
    detector, out = start, []
    for t, cpu, user in samples:
        detector = detector.observe(Readings(other_cpu_percent=cpu, user_idle_s=user), t)
        out.append(detector.idle)
    return out


def every_5s(
    cpus: list[float | None], start: float = 0.0
) -> list[tuple[float, float | None, float | None]]:
    return [(start + 5.0 * i, cpu, None) for i, cpu in enumerate(cpus)]


def idle_detector_after(samples: list[tuple[float, float | None, float | None]]) -> IdleDetector:
    detector = IDLE
    for t, cpu, user in samples:
        detector = detector.observe(Readings(other_cpu_percent=cpu, user_idle_s=user), t)
    return detector


QUIET_MINUTE = every_5s([5.0] * 13)  # t = 0 .. 60: idle exactly at t = 60


def test_becomes_idle_after_exactly_idle_after_s_of_quiet() -> None:
    assert run_detector(QUIET_MINUTE) == [False] * 12 + [True]


def test_starts_busy_even_when_quiet() -> None:
    assert run_detector([(0.0, 0.0, None)]) == [False]


@pytest.mark.parametrize(
    ("name", "cpus"),
    [
        ("hovering around the threshold", [20.0, 30.0] * 20),
        ("one loud sample a minute", ([5.0] * 11 + [80.0]) * 3),
        ("just at the threshold", [25.0] * 30),  # "below" means strictly below
    ],
)
def test_a_busy_machine_does_not_flap_to_idle(name: str, cpus: list[float]) -> None:
    assert not any(run_detector(every_5s(cpus))), name


@pytest.mark.parametrize(
    ("name", "cpus"),
    [
        ("inside the margin", [20.0, 34.0] * 20),
        ("at threshold + margin", [35.0] * 30),  # "above" means strictly above
        ("short spikes", [90.0, 5.0] * 20),  # each shorter than busy_after_s
        ("no reading", [None] * 30),
    ],
)
def test_an_idle_machine_does_not_flap_to_busy(name: str, cpus: list[float | None]) -> None:
    idle = idle_detector_after(QUIET_MINUTE)
    assert idle.idle
    assert all(run_detector(every_5s(cpus, start=65.0), start=idle)), name


def test_sustained_load_ends_idleness_after_busy_after_s() -> None:
    idle = idle_detector_after(QUIET_MINUTE)
    assert run_detector(every_5s([90.0, 90.0, 5.0], start=65.0), start=idle) == [
        True,
        False,  # loud since 65, now 70: 5 s
        False,  # and quiet again does not mean idle again: a new quiet minute is needed
    ]


def test_user_input_ends_idleness_at_once_and_must_age_before_idle_again() -> None:
    idle = idle_detector_after([(t, cpu, 600.0) for t, cpu, _ in QUIET_MINUTE])
    assert idle.idle
    samples: list[tuple[float, float | None, float | None]] = [
        (65.0, 5.0, 1.0),  # a key press, CPU still quiet: busy at once
        (100.0, 5.0, 36.0),
        (125.0, 5.0, 59.0),  # CPU quiet for a minute, but the key press is not a minute old
        (126.0, 5.0, 60.0),
    ]
    assert run_detector(samples, start=idle) == [False, False, False, True]


def test_no_user_idle_source_means_cpu_alone_decides() -> None:
    assert run_detector([(t, cpu, None) for t, cpu, _ in QUIET_MINUTE])[-1]


def test_idle_detector_validates() -> None:
    with pytest.raises(ValueError):
        IdleDetector(threshold=101.0)
    with pytest.raises(ValueError):
        IdleDetector(idle_after_s=-1.0)


def test_decisions_over_a_noisy_afternoon_change_only_twice() -> None:
    """A replayed trace: owner working (noisy), leaves, comes back. Two changes, no flaps."""
    config = PolicyConfig(idle_only=True, idle_threshold_percent=25.0, idle_after_s=60.0)
    working = [40.0, 60.0, 30.0, 80.0, 50.0] * 6
    away = [20.0, 5.0, 28.0, 2.0, 33.0, 10.0] * 5  # quiet with bumps inside the margin
    back = [85.0] * 10
    cpus = [5.0] * 13 + working + [5.0] * 12 + away + back
    samples = [
        (5.0 * i, at("12:00") + timedelta(seconds=5 * i), Readings(other_cpu_percent=cpu))
        for i, cpu in enumerate(cpus)
    ]
    decisions = decide_all(samples, replace(config))
    changes = [
        (i, d.reason_code)
        for i, d in enumerate(decisions)
        if i == 0 or d.run != decisions[i - 1].run
    ]
    assert [code for _, code in changes] == [IN_USE, RUN, IN_USE, RUN, IN_USE]
    assert changes[1][0] == 12  # the start-up minute proves idleness first


# ---- settings --------------------------------------------------------------------------


def test_policy_settings_defaults_keep_a_plain_worker_computing() -> None:
    settings = WorkerSettings()
    assert not settings.idle_only and settings.schedule == "" and settings.snooze_until == ""
    assert settings.pause_on_battery
    assert (settings.idle_threshold_percent, settings.idle_minutes) == (25.0, 5.0)


def test_policy_settings_round_trip_and_keep_unknown_keys(tmp_path: Path) -> None:
    (tmp_path / "settings.json").write_text('{"future_key": [1], "idle_minutes": 10}')
    loaded = WorkerSettings.load(tmp_path)
    assert loaded.idle_minutes == 10.0 and isinstance(loaded.idle_minutes, float)
    changed = replace(
        loaded,
        idle_only=True,
        schedule="22:00-07:00",
        pause_on_battery=False,
        snooze_until="2024-05-02T15:40:00+02:00",
    )
    changed.save(tmp_path)
    assert WorkerSettings.load(tmp_path) == changed
    assert '"future_key"' in (tmp_path / "settings.json").read_text()


@pytest.mark.parametrize(
    "json_text",
    [
        '{"schedule": "22-07"}',
        '{"snooze_until": "soon"}',
        '{"idle_threshold_percent": 150}',
        '{"idle_minutes": 0}',
        '{"idle_only": 1}',
        '{"idle_minutes": "5"}',
    ],
)
def test_bad_policy_settings_are_config_errors(tmp_path: Path, json_text: str) -> None:
    (tmp_path / "settings.json").write_text(json_text)
    with pytest.raises(ConfigError):
        WorkerSettings.load(tmp_path)


# ---- graphics card in use ----------------------------------------------------------------

GPU_FREE_ONLY = PolicyConfig(gpu_only_when_free=True)
NOON = at("12:00")


def test_busy_gpu_pauses_with_its_line() -> None:
    decision = decide(Readings(gpu_busy=True), NOON, GPU_FREE_ONLY)
    assert decision == Decision(
        False, GPU_BUSY, "Paused: graphics card in use", "graphics card in use"
    )


@pytest.mark.parametrize("gpu_busy", [False, None])
def test_free_or_unknown_gpu_runs(gpu_busy: bool | None) -> None:
    assert decide(Readings(gpu_busy=gpu_busy), NOON, GPU_FREE_ONLY).reason_code == RUN


def test_busy_gpu_runs_when_the_flag_is_off() -> None:
    assert decide(Readings(gpu_busy=True), NOON, PolicyConfig()).reason_code == RUN


def test_gpu_busy_priority_after_battery_and_schedule_before_in_use() -> None:
    busy = Readings(gpu_busy=True, on_battery=True)
    assert decide(busy, NOON, GPU_FREE_ONLY).reason_code == ON_BATTERY
    night_only = replace(GPU_FREE_ONLY, schedule=Schedule.parse("22:00-07:00"))
    assert decide(Readings(gpu_busy=True), NOON, night_only).reason_code == OUTSIDE_SCHEDULE
    in_use = replace(GPU_FREE_ONLY, idle_only=True)
    assert decide(Readings(gpu_busy=True), NOON, in_use, idle=False).reason_code == GPU_BUSY
    snoozed = replace(GPU_FREE_ONLY, snooze=Snooze(NOON + timedelta(hours=1)))
    assert decide(Readings(gpu_busy=True), NOON, snoozed).reason_code == SNOOZED


@pytest.mark.parametrize(
    ("use_gpu", "only_when_free", "expected"),
    [(True, True, True), (True, False, False), (False, True, False)],
)
def test_policy_config_gpu_only_when_free(
    use_gpu: bool, only_when_free: bool, expected: bool
) -> None:
    settings = replace(WorkerSettings(), use_gpu=use_gpu, gpu_only_when_free=only_when_free)
    assert policy_config(settings).gpu_only_when_free is expected


def test_sampler_reads_the_gpu_source_and_treats_failure_as_unknown() -> None:
    def broken() -> bool | None:
        raise RuntimeError("NVML went away")

    def sampler(gpu: Callable[[], bool | None] | None) -> Sampler:
        return Sampler(cpu=lambda: 1.0, battery=lambda: None, gpu=gpu)

    assert sampler(lambda: True)().gpu_busy is True
    assert sampler(broken)().gpu_busy is None
    assert sampler(None)().gpu_busy is None
