"""The owner's policy as pure logic: idle hysteresis, schedule, snooze, battery, priority,
temperature limits, and the in-use/idle limits.

Every test injects its readings and its clock; nothing here sleeps or reads the machine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from client_app.config import WorkerSettings
from client_app.policy import (
    GPU_BUSY,
    IN_USE,
    MODE_ALWAYS,
    MODE_IDLE,
    MODE_IN_USE,
    ON_BATTERY,
    OUTSIDE_SCHEDULE,
    RUN,
    SNOOZED,
    TOO_HOT,
    UNKNOWN_TEMP_HOLD_S,
    Decision,
    IdleDetector,
    Limits,
    PolicyConfig,
    Readings,
    Schedule,
    Snooze,
    TempLimit,
    ThermalGuard,
    decide,
    decide_all,
    format_until,
)
from client_app.policy_runner import policy_config
from client_app.readings import Sampler
from common.errors import ConfigError

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


# ---- temperature limits ------------------------------------------------------------------

CPU_85 = TempLimit("CPU", limit_c=85.0, hysteresis_c=5.0)


def run_limit(
    temps: list[float | None], start: TempLimit = CPU_85, every_s: float = 5.0
) -> list[bool]:
    """One reading every ``every_s`` -> whether the part is hot after each."""
    limit, out = start, []
    for i, celsius in enumerate(temps):
        limit = limit.observe(celsius, every_s * i)
        out.append(limit.hot)
    return out


def test_hot_above_the_limit_and_cool_only_at_limit_minus_hysteresis() -> None:
    temps: list[float | None] = [80.0, 85.0, 85.5, 88.0, 84.0, 80.1, 80.0, 79.0, 84.9, 86.0]
    assert run_limit(temps) == [
        False,
        False,  # at the limit is not above it
        True,
        True,
        True,  # below the limit, above 80: still hot (no flapping around 85)
        True,
        False,  # at limit - hysteresis: cool again
        False,
        False,  # cool below the limit stays cool
        True,
    ]


def test_the_reason_keeps_the_reading_that_started_the_pause() -> None:
    limit = CPU_85
    for t, celsius in enumerate([92.0, 95.0, 89.0, 86.5]):
        limit = limit.observe(celsius, float(t))
    assert limit.hot and limit.text == "CPU at 92 °C, limit 85 °C"
    assert TempLimit("GPU", 82.5).observe(85.25, 0.0).text == "GPU at 85.2 °C, limit 82.5 °C"
    assert CPU_85.text == ""


def test_a_missing_reading_holds_a_hot_part_for_a_bounded_time() -> None:
    hot = CPU_85.observe(90.0, 0.0)
    hold = UNKNOWN_TEMP_HOLD_S
    # A one-off failure does not resume a hot CPU...
    assert hot.observe(None, hold - 1).hot
    # ...a sensor that went away does not pause forever...
    assert not hot.observe(None, hold).hot
    # ...and the hold counts from the last real reading, not from the spell's start.
    later = hot.observe(86.0, 40.0).observe(None, 40.0 + hold - 1)
    assert later.hot and not later.observe(None, 40.0 + hold).hot


def test_a_missing_reading_keeps_a_cool_part_cool() -> None:
    assert run_limit([None] * 30) == [False] * 30
    assert run_limit([80.0, None, None, 90.0]) == [False, False, False, True]


def test_nan_is_no_reading() -> None:
    hot = CPU_85.observe(90.0, 0.0)
    assert hot.observe(float("nan"), 1.0).hot
    assert not hot.observe(float("nan"), UNKNOWN_TEMP_HOLD_S).hot
    assert not CPU_85.observe(float("nan"), 0.0).hot


def test_limit_zero_is_no_limit() -> None:
    assert run_limit([140.0] * 3, start=TempLimit("CPU", 0.0)) == [False] * 3
    # A limit turned off mid-spell ends the spell at the next reading.
    hot = CPU_85.observe(90.0, 0.0)
    assert not replace(hot, limit_c=0.0).observe(90.0, 5.0).hot


def test_temp_limit_validates() -> None:
    with pytest.raises(ValueError):
        TempLimit("CPU", limit_c=-1.0)
    with pytest.raises(ValueError):
        TempLimit("CPU", limit_c=80.0, hysteresis_c=-1.0)


def test_guard_names_the_part_that_got_hot_first() -> None:
    guard = ThermalGuard.with_limits(max_cpu_c=85.0, max_gpu_c=80.0)
    guard = guard.observe(Readings(cpu_temp_c=70.0, gpu_temp_c=81.0), 0.0)
    assert guard.cause is not None and guard.cause.text == "GPU at 81 °C, limit 80 °C"
    guard = guard.observe(Readings(cpu_temp_c=90.0, gpu_temp_c=83.0), 5.0)
    assert guard.cause is not None and guard.cause.part == "GPU"  # the CPU joins, no change
    guard = guard.observe(Readings(cpu_temp_c=90.0, gpu_temp_c=70.0), 10.0)
    assert guard.cause is not None and guard.cause.text == "CPU at 90 °C, limit 85 °C"
    assert guard.observe(Readings(cpu_temp_c=60.0, gpu_temp_c=60.0), 15.0).cause is None


def test_retuned_guard_keeps_the_spell_and_judges_by_the_new_limit() -> None:
    guard = ThermalGuard.with_limits(max_cpu_c=85.0).observe(Readings(cpu_temp_c=90.0), 0.0)
    retuned = guard.retuned(95.0, 0.0, 5.0)
    assert retuned.cause is not None  # no reading yet: still the old spell
    assert retuned.observe(Readings(cpu_temp_c=89.0), 5.0).cause is None  # 89 <= 95 - 5


HOT = TempLimit("CPU", 85.0).observe(92.0, 0.0)


def test_too_hot_pauses_with_its_line_and_reason() -> None:
    decision = decide(Readings(cpu_temp_c=92.0), NOON, PolicyConfig(), too_hot=HOT)
    assert (decision.run, decision.reason_code) == (False, TOO_HOT)
    assert decision.line == "Paused: CPU at 92 °C, limit 85 °C"
    assert decision.reason == "CPU at 92 °C, limit 85 °C"
    assert decide(Readings(), NOON, PolicyConfig(), too_hot=CPU_85).run  # a cool part


def test_too_hot_priority_after_schedule_before_gpu_busy_and_in_use() -> None:
    everything = PolicyConfig(
        idle_only=True,
        schedule=Schedule.parse("22:00-07:00"),
        snooze=Snooze(NOON + timedelta(hours=1)),
        gpu_only_when_free=True,
    )
    readings = Readings(on_battery=True, gpu_busy=True)
    expected = [SNOOZED, ON_BATTERY, OUTSIDE_SCHEDULE, TOO_HOT, GPU_BUSY, IN_USE, RUN]
    config, seen = everything, []
    too_hot: TempLimit | None = HOT
    idle = False
    for _ in expected:
        seen.append(decide(readings, NOON, config, idle=idle, too_hot=too_hot).reason_code)
        # Clear the rule that just won, and the next one down must show.
        if seen[-1] == SNOOZED:
            config = replace(config, snooze=Snooze())
        elif seen[-1] == ON_BATTERY:
            readings = replace(readings, on_battery=False)
        elif seen[-1] == OUTSIDE_SCHEDULE:
            config = replace(config, schedule=Schedule())
        elif seen[-1] == TOO_HOT:
            too_hot = None
        elif seen[-1] == GPU_BUSY:
            readings = replace(readings, gpu_busy=False)
        elif seen[-1] == IN_USE:
            idle = True
    assert seen == expected


def test_decide_all_runs_the_thermal_guard() -> None:
    config = PolicyConfig(max_cpu_temp_c=85.0, temp_hysteresis_c=5.0)
    temps = [70.0, 90.0, 84.0, None, 82.0, 80.0, 75.0]
    samples = [
        (5.0 * i, NOON + timedelta(seconds=5 * i), Readings(cpu_temp_c=c))
        for i, c in enumerate(temps)
    ]
    codes = [d.reason_code for d in decide_all(samples, config)]
    assert codes == [RUN, TOO_HOT, TOO_HOT, TOO_HOT, TOO_HOT, RUN, RUN]


@pytest.mark.parametrize(("use_gpu", "expected"), [(True, 80.0), (False, 0.0)])
def test_policy_config_gpu_limit_only_when_the_gpu_is_used(use_gpu: bool, expected: float) -> None:
    settings = WorkerSettings(
        use_gpu=use_gpu, max_cpu_temp_c=90.0, max_gpu_temp_c=80.0, temp_hysteresis_c=3.0
    )
    config = policy_config(settings)
    assert (config.max_cpu_temp_c, config.max_gpu_temp_c) == (90.0, expected)
    assert config.temp_hysteresis_c == 3.0
    hot_gpu = config.new_guard().observe(Readings(gpu_temp_c=95.0), 0.0)
    assert (hot_gpu.cause is not None) is use_gpu


def test_sampler_reads_temperatures_and_treats_failure_as_unknown() -> None:
    def broken() -> float | None:
        raise OSError("sensor gone")

    def sampler(cpu_temp: Callable[[], float | None] | None) -> Sampler:
        return Sampler(cpu=lambda: 1.0, battery=lambda: None, cpu_temp=cpu_temp, gpu_temp=broken)

    assert sampler(lambda: 71.0)() == Readings(other_cpu_percent=1.0, cpu_temp_c=71.0)
    assert sampler(broken)().cpu_temp_c is None
    assert sampler(None)().cpu_temp_c is None


# ---- in use vs idle limits -----------------------------------------------------------------

SPLIT = PolicyConfig(cpu_percent=100, threads=2, in_use_cpu_percent=30, in_use_threads=1)


def test_limits_follow_the_mode() -> None:
    in_use = decide(Readings(), NOON, SPLIT, idle=False)
    idle = decide(Readings(), NOON, SPLIT, idle=True)
    assert in_use.run and in_use.limits == Limits(30, 1, MODE_IN_USE)
    assert idle.run and idle.limits == Limits(100, 2, MODE_IDLE)


def test_limits_name_no_mode_when_both_sets_are_the_same_and_show_it_while_paused() -> None:
    same = PolicyConfig(cpu_percent=50, threads=2, in_use_cpu_percent=50)
    assert decide(Readings(), NOON, same, idle=False).limits == Limits(50, 2, MODE_ALWAYS)
    assert decide(Readings(), NOON, same, idle=True).limits == Limits(50, 2, MODE_ALWAYS)
    idle_only = replace(same, idle_only=True)  # in use pauses: the two sets differ
    assert decide(Readings(), NOON, idle_only, idle=True).limits == Limits(50, 2, MODE_IDLE)
    assert decide(Readings(), NOON, idle_only, idle=False).limits.mode == MODE_IN_USE
    on_battery = decide(Readings(on_battery=True), NOON, SPLIT, idle=False)
    assert not on_battery.run and on_battery.limits == Limits(30, 1, MODE_IN_USE)


def test_in_use_cpu_percent_zero_pauses_like_idle_only() -> None:
    zero = replace(SPLIT, in_use_cpu_percent=0)
    paused = decide(Readings(), NOON, zero, idle=False)
    idle_only = decide(Readings(), NOON, replace(SPLIT, idle_only=True), idle=False)
    assert paused == Decision(
        False, IN_USE, "Paused: computer in use", "computer in use", Limits(0, 1, MODE_IN_USE)
    )
    assert (paused.reason_code, paused.reason) == (idle_only.reason_code, idle_only.reason)
    assert decide(Readings(), NOON, zero, idle=True).run


def test_policy_config_maps_the_in_use_limits() -> None:
    config = policy_config(
        WorkerSettings(threads=4, cpu_percent=80, in_use_cpu_percent=20, in_use_threads=1)
    )
    assert config.limits(idle=True) == Limits(80, 4, MODE_IDLE)
    assert config.limits(idle=False) == Limits(20, 1, MODE_IN_USE)
    same_threads = policy_config(WorkerSettings(threads=3))
    assert same_threads.limits(idle=False) == Limits(100, 3, MODE_ALWAYS)


def test_in_use_limits_only_tighten_the_idle_ones() -> None:
    # An owner who limited the CPU time before in-use limits existed keeps that limit
    # while using the computer: the in-use defaults (100%, same threads) loosen nothing.
    older = policy_config(WorkerSettings(cpu_percent=50, threads=2))
    assert older.limits(idle=False) == older.limits(idle=True) == Limits(50, 2, MODE_ALWAYS)
    looser = policy_config(
        WorkerSettings(cpu_percent=40, threads=2, in_use_cpu_percent=90, in_use_threads=8)
    )
    assert looser.limits(idle=False) == Limits(40, 2, MODE_ALWAYS)
    tighter = policy_config(
        WorkerSettings(cpu_percent=80, threads=4, in_use_cpu_percent=25, in_use_threads=1)
    )
    assert tighter.limits(idle=False) == Limits(25, 1, MODE_IN_USE)
