"""PolicyRunner against a fake core with scripted readings; readings.py never raising;
the ``cleave-worker`` policy flags."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from support.fake_coordinator import FakeCoordinator, within

from client_app import cli, readings
from client_app.config import WorkerSettings
from client_app.policy import (
    IN_USE,
    MODE_IDLE,
    MODE_IN_USE,
    ON_BATTERY,
    RUN,
    TOO_HOT,
    Decision,
    PolicyConfig,
    Readings,
    Schedule,
    Snooze,
)
from client_app.policy_runner import PolicyRunner, policy_config
from common.messages import Pause

pytestmark = pytest.mark.timeout(30)

TZ = timezone(timedelta(hours=1))
NOON = datetime(2024, 5, 2, 12, 0, tzinfo=TZ)


class FakeCore:
    """Records pauses in ``calls`` and the limit setters apart, in ``limit_calls``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.limit_calls: list[tuple[str, int | str]] = []

    def pause(self, reason: str) -> None:
        self.calls.append(("pause", reason))

    def resume(self) -> None:
        self.calls.append(("resume",))

    def set_cpu_percent(self, percent: int) -> None:
        self.limit_calls.append(("cpu", percent))

    def set_threads(self, threads: int) -> None:
        self.limit_calls.append(("threads", threads))

    def set_limits_mode(self, mode: str) -> None:
        self.limit_calls.append(("mode", mode))


class Clock:
    """One injected time for both clocks: wall (local, aware) and monotonic."""

    def __init__(self, start: datetime = NOON) -> None:
        self.start = start
        self.t = 0.0

    def now(self) -> datetime:
        return self.start + timedelta(seconds=self.t)

    def monotonic(self) -> float:
        return self.t


def make_runner(
    config: PolicyConfig | WorkerSettings, clock: Clock, script: list[Readings] | None = None
) -> tuple[PolicyRunner, FakeCore]:
    core = FakeCore()
    feed: Iterator[Readings] = iter(script or [])
    runner = PolicyRunner(
        core,
        config,
        sample=lambda: next(feed, Readings()),
        clock=clock.now,
        monotonic=clock.monotonic,
        interval_s=0.01,
    )
    return runner, core


def test_pauses_and_resumes_only_on_changes() -> None:
    clock = Clock()
    runner, core = make_runner(PolicyConfig(), clock)
    battery, mains = Readings(on_battery=True), Readings(on_battery=False)
    for reading in [mains, mains, battery, battery, battery, mains, mains, battery]:
        runner.step(reading)
        clock.t += 5
    assert core.calls == [("pause", "on battery"), ("resume",), ("pause", "on battery")]
    assert runner.decision is not None and runner.decision.reason_code == ON_BATTERY


def test_starts_paused_and_sends_a_new_reason_when_the_cause_changes() -> None:
    clock = Clock(NOON.replace(hour=21, minute=59, second=50))
    runner, core = make_runner(PolicyConfig(schedule=Schedule.parse("22:00-07:00")), clock)
    runner.step(Readings(on_battery=True))  # the very first step pauses
    clock.t = 5
    runner.step(Readings(on_battery=False))  # still outside the schedule: a new reason
    clock.t = 10
    runner.step(Readings(on_battery=False))  # 22:00: inside
    assert core.calls == [("pause", "on battery"), ("pause", "outside schedule"), ("resume",)]


def test_idle_only_waits_for_a_quiet_spell_and_ignores_noise() -> None:
    clock = Clock()
    config = PolicyConfig(idle_only=True, idle_after_s=30.0)
    runner, core = make_runner(config, clock)
    cpus = [5.0] * 7 + [90.0, 5.0, 30.0, 5.0, 34.0] * 4 + [90.0] * 3
    for cpu in cpus:
        runner.step(Readings(other_cpu_percent=cpu))
        clock.t += 5
    assert core.calls == [("pause", "computer in use"), ("resume",), ("pause", "computer in use")]


def test_snooze_applies_at_once_and_expires() -> None:
    clock = Clock(NOON.replace(hour=14, minute=40))
    runner, core = make_runner(PolicyConfig(), clock)
    runner.step(Readings())
    runner.snooze(Snooze.for_duration(clock.now()))
    decision = runner.step(Readings())
    assert decision.line == "Snoozed until 15:40"
    clock.t = 3600
    assert runner.step(Readings()).run
    assert core.calls == [("pause", "snoozed until 15:40"), ("resume",)]


def test_settings_map_onto_the_policy() -> None:
    settings = WorkerSettings(
        idle_only=True,
        idle_threshold_percent=10.0,
        idle_minutes=2.5,
        pause_on_battery=False,
        schedule="22:00-07:00",
        snooze_until="2024-05-02T15:40:00",  # naive: read as local time
    )
    config = policy_config(settings)
    assert config.idle_only and not config.pause_on_battery
    assert (config.idle_threshold_percent, config.idle_after_s) == (10.0, 150.0)
    assert config.schedule == Schedule.parse("22:00-07:00")
    assert config.snooze.until is not None and config.snooze.until.tzinfo is not None


def test_set_config_from_settings_keeps_the_idle_history() -> None:
    clock = Clock()
    runner, core = make_runner(WorkerSettings(idle_only=True, idle_minutes=1.0), clock)
    for _ in range(7):  # quiet for 30 s of the minute asked for
        runner.step(Readings(other_cpu_percent=1.0))
        clock.t += 5
    runner.set_config(WorkerSettings(idle_only=True, idle_minutes=2.0))
    clock.t = 60
    assert runner.step(Readings(other_cpu_percent=1.0)).reason_code == IN_USE  # now 2 min
    clock.t = 120
    assert runner.step(Readings(other_cpu_percent=1.0)).run  # counted from t=0, not restarted
    assert core.calls == [("pause", "computer in use"), ("resume",)]


async def test_run_ticks_until_stopped_from_another_thread() -> None:
    clock = Clock()
    script = [Readings(on_battery=True)] * 3 + [Readings(on_battery=False)] * 1000
    runner, core = make_runner(PolicyConfig(), clock, script)
    seen: list[Decision] = []
    runner._on_decision = seen.append  # observe changes

    task = asyncio.ensure_future(runner.run())
    for _ in range(500):  # bounded: ~5 s at most
        if core.calls == [("pause", "on battery"), ("resume",)]:
            break
        await asyncio.sleep(0.01)
    threading.Thread(target=runner.stop).start()
    await asyncio.wait_for(task, 5)
    assert core.calls == [("pause", "on battery"), ("resume",)]
    assert [d.reason_code for d in seen] == [ON_BATTERY, RUN]


# ---- temperature limits ------------------------------------------------------------------

HOT_85 = WorkerSettings(max_cpu_temp_c=85.0, temp_hysteresis_c=5.0, use_gpu=False)


def test_a_hot_cpu_pauses_within_one_tick_and_resumes_at_limit_minus_hysteresis() -> None:
    clock = Clock()
    runner, core = make_runner(HOT_85, clock)
    line = "Paused: CPU at 92 °C, limit 85 °C"
    # (reading, expected code after this very step)
    script = [(70.0, RUN), (92.0, TOO_HOT), (93.5, TOO_HOT), (84.0, TOO_HOT), (80.5, TOO_HOT)]
    script += [(80.0, RUN), (84.0, RUN), (85.0, RUN)]
    for celsius, code in script:
        decision = runner.step(Readings(cpu_temp_c=celsius))
        assert decision.reason_code == code, (celsius, decision)
        assert decision.line == (line if code == TOO_HOT else "")
        clock.t += 5
    # One pause: the reading wiggling inside the spell never re-sent it.
    assert core.calls == [("pause", "CPU at 92 °C, limit 85 °C"), ("resume",)]


def test_a_lost_sensor_resumes_after_the_hold_but_a_one_off_failure_does_not() -> None:
    clock = Clock()
    runner, core = make_runner(HOT_85, clock)
    runner.step(Readings(cpu_temp_c=90.0))
    for _ in range(11):  # 55 s of failed reads
        clock.t += 5
        assert runner.step(Readings()).reason_code == TOO_HOT
    clock.t += 5  # 60 s since the last reading
    assert runner.step(Readings()).run
    assert core.calls == [("pause", "CPU at 90 °C, limit 85 °C"), ("resume",)]


def test_gpu_limit_is_ignored_when_the_worker_does_not_use_the_gpu() -> None:
    clock = Clock()
    hot_gpu = Readings(gpu_temp_c=95.0)
    runner, core = make_runner(replace(HOT_85, max_gpu_temp_c=80.0), clock)
    assert runner.step(hot_gpu).run and core.calls == []
    runner, core = make_runner(replace(HOT_85, max_gpu_temp_c=80.0, use_gpu=True), clock)
    assert runner.step(hot_gpu).line == "Paused: GPU at 95 °C, limit 80 °C"


def test_new_limits_keep_a_hot_spell_and_judge_it_by_the_new_numbers() -> None:
    clock = Clock()
    runner, core = make_runner(HOT_85, clock)
    runner.step(Readings(cpu_temp_c=90.0))
    runner.set_config(replace(HOT_85, max_cpu_temp_c=0.0))  # limit off: resume
    clock.t = 5
    assert runner.step(Readings(cpu_temp_c=90.0)).run
    assert core.calls == [("pause", "CPU at 90 °C, limit 85 °C"), ("resume",)]


# ---- in use vs idle limits -----------------------------------------------------------------

SPLIT = WorkerSettings(
    cpu_percent=100, threads=2, in_use_cpu_percent=30, in_use_threads=1, idle_minutes=1.0
)
IN_USE_LIMITS = [("cpu", 30), ("threads", 1), ("mode", MODE_IN_USE)]
IDLE_LIMITS = [("cpu", 100), ("threads", 2), ("mode", MODE_IDLE)]


def test_limits_switch_after_the_grace_period_and_back_at_once_on_input() -> None:
    clock = Clock()
    runner, core = make_runner(SPLIT, clock)
    quiet = Readings(other_cpu_percent=5.0, user_idle_s=600.0)
    for _ in range(12):  # t = 0 .. 55: quiet, but not yet for the minute asked
        assert runner.step(quiet).limits.mode == MODE_IN_USE
        clock.t += 5
    assert core.limit_calls == IN_USE_LIMITS  # the first step states them, once
    assert runner.step(quiet).limits.mode == MODE_IDLE  # t = 60
    for _ in range(5):
        clock.t += 5
        runner.step(quiet)
    assert core.limit_calls == IN_USE_LIMITS + IDLE_LIMITS
    clock.t += 5
    assert runner.step(Readings(other_cpu_percent=5.0, user_idle_s=1.0)).limits.mode == (
        MODE_IN_USE  # a key press: at once
    )
    assert core.limit_calls == IN_USE_LIMITS + IDLE_LIMITS + IN_USE_LIMITS
    assert core.calls == []  # limits change, computing goes on


def test_only_the_limits_that_change_are_sent() -> None:
    clock = Clock()
    same_threads = replace(SPLIT, in_use_threads=0)  # in use: the same 2 threads
    runner, core = make_runner(same_threads, clock)
    for _ in range(13):
        runner.step(Readings(other_cpu_percent=5.0))
        clock.t += 5
    assert core.limit_calls == [
        ("cpu", 30),
        ("threads", 2),
        ("mode", MODE_IN_USE),
        ("cpu", 100),
        ("mode", MODE_IDLE),
    ]


def test_new_settings_restate_the_limits_at_the_next_step_but_a_snooze_does_not() -> None:
    clock = Clock()
    runner, core = make_runner(SPLIT, clock)
    runner.step(Readings())
    runner.step(Readings())
    runner.snooze(Snooze.for_duration(clock.now()))
    runner.step(Readings())
    assert core.limit_calls == IN_USE_LIMITS
    runner.set_config(replace(SPLIT, in_use_cpu_percent=40))
    assert core.limit_calls == IN_USE_LIMITS  # not before the step
    runner.step(Readings())
    assert core.limit_calls == IN_USE_LIMITS + [("cpu", 40), ("threads", 1), ("mode", MODE_IN_USE)]


def test_in_use_cpu_percent_zero_pauses_while_in_use_like_idle_only() -> None:
    clock = Clock()
    runner, core = make_runner(replace(SPLIT, in_use_cpu_percent=0), clock)
    for _ in range(13):
        runner.step(Readings(other_cpu_percent=5.0))
        clock.t += 5
    assert core.calls == [("pause", "computer in use"), ("resume",)]
    # 0% is never sent (the pause covers it); the idle share is.
    assert core.limit_calls == [
        ("threads", 1),
        ("mode", MODE_IN_USE),
        ("cpu", 100),
        ("threads", 2),
        ("mode", MODE_IDLE),
    ]


def test_limits_are_set_before_a_resume_in_the_same_step() -> None:
    events: list[str] = []

    class Ordered(FakeCore):
        def resume(self) -> None:
            events.append("resume")

        def set_cpu_percent(self, percent: int) -> None:
            events.append(f"cpu {percent}")

    clock = Clock()
    runner = PolicyRunner(
        Ordered(),
        replace(SPLIT, in_use_cpu_percent=0),
        clock=clock.now,
        monotonic=clock.monotonic,
    )
    for _ in range(13):
        runner.step(Readings(other_cpu_percent=5.0))
        clock.t += 5
    assert events == ["cpu 100", "resume"]


def test_rejects_a_bad_interval() -> None:
    with pytest.raises(ValueError):
        PolicyRunner(FakeCore(), PolicyConfig(), interval_s=0)


# ---- readings: the I/O side never raises -------------------------------------------------


def test_sampler_turns_failing_sources_into_none() -> None:
    def boom() -> Any:
        raise OSError("no such sensor")

    sample = readings.Sampler(cpu=boom, user_idle=boom, battery=boom)()
    assert sample == Readings()


def test_cpu_sampler_gives_a_machine_percentage() -> None:
    cpu = readings.CpuSampler()
    for _ in range(3):
        value = cpu()
        assert value is not None and 0.0 <= value <= 100.0


def test_battery_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    class Battery:
        def __init__(self, plugged: bool | None) -> None:
            self.power_plugged = plugged

    for battery, expected in [
        (None, None),
        (Battery(True), False),
        (Battery(False), True),
        (Battery(None), None),
    ]:
        monkeypatch.setattr(readings.psutil, "sensors_battery", lambda b=battery: b)
        assert readings.on_battery() is expected

    def unsupported() -> None:
        raise NotImplementedError

    monkeypatch.setattr(readings.psutil, "sensors_battery", unsupported)
    assert readings.on_battery() is None


def test_user_idle_source_is_none_where_there_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISPLAY", raising=False)
    assert readings.user_idle_source("linux") is None
    assert readings.user_idle_source("sunos5") is None
    monkeypatch.setenv("DISPLAY", ":999")  # no such display (or no libXss): still None
    assert readings.user_idle_source("linux") is None


def test_macos_hid_idle_time_is_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    class Done:
        stdout = '  |   "HIDIdleTime" = 2500000000\n'

    monkeypatch.setattr(readings.subprocess, "run", lambda *a, **k: Done())
    assert readings._macos_idle() == 2.5


def test_module_sample_reads_this_machine() -> None:
    sample = readings.sample()
    assert sample.other_cpu_percent is None or 0.0 <= sample.other_cpu_percent <= 100.0


# ---- cleave-worker flags -----------------------------------------------------------------


def test_policy_flags_override_saved_settings() -> None:
    args = cli.build_parser().parse_args(
        [
            "--idle-only",
            "--idle-threshold",
            "0",
            "--idle-minutes",
            "2.5",
            "--schedule",
            "22:00-07:00",
            "--no-battery-pause",
        ]
    )
    saved = WorkerSettings(schedule="01:00-02:00", snooze_until="2024-05-02T15:40:00")
    settings = cli._settings_from_args(args, saved)
    assert settings.idle_only and not settings.pause_on_battery
    assert (settings.idle_threshold_percent, settings.idle_minutes) == (0.0, 2.5)
    assert settings.schedule == "22:00-07:00"
    assert settings.snooze_until == saved.snooze_until  # no flag for it: kept
    untouched = cli._settings_from_args(cli.build_parser().parse_args([]), saved)
    assert untouched == saved


@pytest.mark.parametrize(
    "argv",
    [
        ["--schedule", "22-07"],
        ["--idle-threshold", "101"],
        ["--idle-minutes", "0"],
    ],
)
def test_bad_policy_flags_exit_with_usage_error(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLEAVE_CONFIG_DIR", str(tmp_path))
    with pytest.raises(SystemExit) as info:
        cli.main(["--coordinator", "ws://127.0.0.1:1/ws", *argv])
    assert info.value.code == cli.EXIT_USAGE


async def test_cleave_worker_runs_the_policy_next_to_the_core(tmp_path: Path) -> None:
    """A real process outside its schedule tells the coordinator why it is paused."""
    now = datetime.now()
    start, end = now + timedelta(hours=2), now + timedelta(hours=3)  # never contains now
    schedule = f"{start:%H:%M}-{end:%H:%M}"
    package_root = Path(cli.__file__).resolve().parent.parent
    env = dict(os.environ, CLEAVE_CONFIG_DIR=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join([str(package_root), env.get("PYTHONPATH", "")])

    async with FakeCoordinator() as coord:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "client_app", "--coordinator", coord.url,
            "--threads", "1", "--no-gpu", "--schedule", schedule,
            env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        assert proc.stdout is not None
        try:
            link = await coord.next_link(timeout=25)
            assert (await link.expect(Pause, timeout=10)).message == Pause("outside schedule")
            proc.send_signal(signal.SIGTERM)
            code = await within(proc.wait(), 15)
            output = (await within(proc.stdout.read())).decode(errors="replace")
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    assert code == cli.EXIT_OK, output
    assert f"schedule {schedule}" in output and "Paused: outside schedule" in output


async def test_a_reading_that_raises_is_treated_as_unknown_and_the_runner_goes_on() -> None:
    import asyncio

    from client_app.policy import PolicyConfig
    from client_app.policy_runner import PolicyRunner

    calls: list[str] = []

    class Core(FakeCore):
        def pause(self, reason: str) -> None:
            calls.append(f"pause:{reason}")

        def resume(self) -> None:
            calls.append("resume")

    def broken() -> Readings:
        raise OSError("sensor gone")

    runner = PolicyRunner(Core(), PolicyConfig(), sample=broken, interval_s=0.01)
    task = asyncio.ensure_future(runner.run())
    await asyncio.sleep(0.1)
    assert not task.done()  # still ticking despite the broken sensor
    runner.stop()
    await asyncio.wait_for(task, 2)
    assert not any(c.startswith("pause") for c in calls), calls
