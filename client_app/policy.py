"""When and how hard the owner lets this machine compute: idle detection, battery,
schedule, snooze, temperature limits, and the limits while the computer is in use.

Pure logic in the websockets/Flower style (DESIGN §5): no I/O, no clocks read here.
Callers pass readings (``client_app.readings``), a local wall-clock ``datetime`` for the
schedule and snooze, and a monotonic ``float`` for the idle detector's and the thermal
guard's timers (so a wall-clock jump, e.g. an NTP step or a DST change, cannot fake
minutes of idleness).
``client_app.policy_runner`` is the thin loop that applies decisions to a WorkerCore.

Priority, highest first: snooze > battery > schedule > too hot > graphics card in use >
computer in use. A person's explicit "not now" beats every automatic rule, and among
the automatic ones the line shown is the most lasting cause (on battery until plugged
in, the schedule until its next window, a hot part cools in minutes, a busy GPU or "in
use" may clear at any moment).

Whether it runs or not, a decision also names the limits in force (``Limits``): the
owner's in-use CPU share and threads while the idle detector says "in use", the
ordinary ones while it says "idle". The detector's grace periods are what keep the
limits from flapping.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

SECONDS_PER_DAY = 24 * 60 * 60

# Decision.reason_code values: stable identifiers for code (a GUI icon, tests); the
# human text lives in Decision.line and Decision.reason.
RUN = "run"
SNOOZED = "snoozed"
ON_BATTERY = "on_battery"
OUTSIDE_SCHEDULE = "outside_schedule"
TOO_HOT = "too_hot"
GPU_BUSY = "gpu_busy"
IN_USE = "in_use"

# Limits.mode values, shown in WorkerStatus.limits_mode.
MODE_IN_USE = "in use"
MODE_IDLE = "idle"
MODE_ALWAYS = "always"  # the same limits either way: saying which would suggest a switch

# How long a missing temperature keeps a hot part paused (ThermalGuard).
UNKNOWN_TEMP_HOLD_S = 60.0


@dataclass(frozen=True)
class Readings:
    """One sample of the machine; None means the source is unavailable here."""

    other_cpu_percent: float | None = None  # other processes' CPU, 0-100 of the machine
    user_idle_s: float | None = None  # seconds since the last keyboard/mouse input
    on_battery: bool | None = None  # None: no battery or unknown, treated as mains
    gpu_busy: bool | None = None  # another program uses the GPU; None: no GPU or unknown
    cpu_temp_c: float | None = None  # the hottest CPU sensor, °C; None: no sensor or unknown
    gpu_temp_c: float | None = None  # the GPU's core, °C; None: no GPU, no NVML or unknown


# ---- idle detection --------------------------------------------------------------------


@dataclass(frozen=True)
class IdleDetector:
    """Answers "is the owner using this computer?", with hysteresis so it does not flap.

    Becomes idle once other processes' CPU has stayed below ``threshold`` for
    ``idle_after_s`` (and, where a user-input reading exists, nobody has touched the
    keyboard or mouse for as long). Becomes busy again when the CPU stays above
    ``threshold + margin`` for ``busy_after_s``, or at once on user input. Between
    ``threshold`` and ``threshold + margin`` nothing changes: load hovering around the
    threshold keeps whichever state holds. Immutable: ``observe`` returns the next state.

    It starts busy: with idle-only on, the first ``idle_after_s`` after start-up prove
    idleness instead of assuming it.
    """

    threshold: float = 25.0
    idle_after_s: float = 300.0
    margin: float = 10.0
    busy_after_s: float = 5.0
    idle: bool = False
    quiet_since: float | None = None  # monotonic time the CPU went below threshold
    loud_since: float | None = None  # monotonic time the CPU went above threshold+margin

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 100.0:
            raise ValueError(f"threshold must be in [0, 100] percent, not {self.threshold}")
        if self.idle_after_s < 0 or self.busy_after_s < 0 or self.margin < 0:
            raise ValueError("idle_after_s, busy_after_s and margin must be >= 0")

    def observe(self, readings: Readings, t: float) -> IdleDetector:
        """The state after seeing ``readings`` at monotonic time ``t`` (seconds)."""
        cpu = readings.other_cpu_percent
        quiet_since, loud_since = self.quiet_since, self.loud_since
        # No CPU reading is no evidence either way: keep the timers as they are rather
        # than invent a quiet or a loud period.
        if cpu is not None:
            quiet, loud = cpu < self.threshold, cpu > self.threshold + self.margin
            quiet_since = (t if quiet_since is None else quiet_since) if quiet else None
            loud_since = (t if loud_since is None else loud_since) if loud else None
        user_active = readings.user_idle_s is not None and readings.user_idle_s < self.idle_after_s
        if self.idle:
            busy = user_active or (loud_since is not None and t - loud_since >= self.busy_after_s)
            idle = not busy
        else:
            idle = (
                not user_active and quiet_since is not None and t - quiet_since >= self.idle_after_s
            )
        return replace(self, idle=idle, quiet_since=quiet_since, loud_since=loud_since)


# ---- temperature limits ----------------------------------------------------------------


def _degrees(celsius: float) -> str:
    # Tenths at most: sensors report whole or half degrees, and "85.4 °C" still shows
    # why a reading just over an 85 °C limit counts as over it.
    return f"{round(celsius, 1):g}"


@dataclass(frozen=True)
class TempLimit:
    """One part's temperature limit with hysteresis: hot above ``limit_c``, cool again
    only at or below ``limit_c - hysteresis_c``; ``limit_c`` 0 is no limit.

    A missing reading (None: a read failed, or the sensor vanished) is no evidence: a
    cool part stays cool, and a hot part stays hot for ``hold_s`` after its last real
    reading, then counts as cool. So one failed read cannot resume a hot CPU, and a
    sensor that disappears cannot pause the worker forever: after the hold it behaves
    like a machine that never had a sensor, where the limit cannot apply either.
    Immutable: ``observe`` returns the next state.
    """

    part: str  # "CPU" or "GPU", as the status line names it
    limit_c: float = 0.0
    hysteresis_c: float = 5.0
    hold_s: float = UNKNOWN_TEMP_HOLD_S
    hot_at_c: float | None = None  # the reading that started this hot spell; None: cool
    hot_since: float | None = None  # monotonic time the spell started
    seen_at: float | None = None  # monotonic time of the spell's last real reading

    def __post_init__(self) -> None:
        if self.limit_c < 0 or self.hysteresis_c < 0 or self.hold_s < 0:
            raise ValueError("limit_c, hysteresis_c and hold_s must be >= 0")

    @property
    def hot(self) -> bool:
        return self.hot_at_c is not None

    @property
    def text(self) -> str:
        """ "CPU at 92 °C, limit 85 °C": the reading that started the spell, not the
        latest one, so the reason sent to the coordinator stays put while it wiggles."""
        if self.hot_at_c is None:
            return ""
        return f"{self.part} at {_degrees(self.hot_at_c)} °C, limit {_degrees(self.limit_c)} °C"

    def observe(self, celsius: float | None, t: float) -> TempLimit:
        """The state after reading ``celsius`` (None: unknown) at monotonic time ``t``."""
        cool = replace(self, hot_at_c=None, hot_since=None, seen_at=None)
        if celsius is not None and not math.isfinite(celsius):
            celsius = None  # a NaN would compare neither hot nor cool: it is no reading
        if self.limit_c <= 0:
            return cool
        if celsius is None:
            if self.seen_at is not None and t - self.seen_at >= self.hold_s:
                return cool
            return self
        if self.hot_at_c is None:
            if celsius > self.limit_c:
                return replace(self, hot_at_c=celsius, hot_since=t, seen_at=t)
            return self
        if celsius <= self.limit_c - self.hysteresis_c:
            return cool
        return replace(self, seen_at=t)


@dataclass(frozen=True)
class ThermalGuard:
    """The CPU's and the GPU's limits together; ``cause`` is the part to blame, if any.

    When both are hot the one that got hot first is named, so a second part joining in
    does not change the reason under way.
    """

    cpu: TempLimit = field(default_factory=lambda: TempLimit("CPU"))
    gpu: TempLimit = field(default_factory=lambda: TempLimit("GPU"))

    @classmethod
    def with_limits(
        cls, max_cpu_c: float = 0.0, max_gpu_c: float = 0.0, hysteresis_c: float = 5.0
    ) -> ThermalGuard:
        return cls(
            TempLimit("CPU", max_cpu_c, hysteresis_c), TempLimit("GPU", max_gpu_c, hysteresis_c)
        )

    def retuned(self, max_cpu_c: float, max_gpu_c: float, hysteresis_c: float) -> ThermalGuard:
        """New limits, same hot spells: the next ``observe`` judges them by the new ones."""
        return ThermalGuard(
            replace(self.cpu, limit_c=max_cpu_c, hysteresis_c=hysteresis_c),
            replace(self.gpu, limit_c=max_gpu_c, hysteresis_c=hysteresis_c),
        )

    def observe(self, readings: Readings, t: float) -> ThermalGuard:
        return ThermalGuard(
            self.cpu.observe(readings.cpu_temp_c, t), self.gpu.observe(readings.gpu_temp_c, t)
        )

    @property
    def cause(self) -> TempLimit | None:
        hot = [part for part in (self.cpu, self.gpu) if part.hot_since is not None]
        return min(hot, key=lambda part: part.hot_since or 0.0) if hot else None


# ---- schedule --------------------------------------------------------------------------


def _parse_clock(text: str, *, allow_24: bool) -> int:
    """Seconds after midnight of "HH:MM"; "24:00" only as a window's end."""
    hh, sep, mm = text.strip().partition(":")
    if not sep or not (hh.isdigit() and mm.isdigit()) or len(mm) != 2 or not 1 <= len(hh) <= 2:
        raise ValueError(f"{text.strip()!r} is not a time like 07:30")
    hours, minutes = int(hh), int(mm)
    if hours == 24 and minutes == 0 and allow_24:
        return SECONDS_PER_DAY
    if hours > 23 or minutes > 59:
        raise ValueError(f"{text.strip()!r} is not a time of day")
    return hours * 3600 + minutes * 60


@dataclass(frozen=True)
class Window:
    """Allowed from ``start_s`` (inclusive) to ``end_s`` (exclusive), seconds after
    midnight; ``end_s < start_s`` spans midnight ("22:00-07:00")."""

    start_s: int
    end_s: int

    def contains(self, second_of_day: float) -> bool:
        if self.start_s < self.end_s:
            return self.start_s <= second_of_day < self.end_s
        return second_of_day >= self.start_s or second_of_day < self.end_s


@dataclass(frozen=True)
class Schedule:
    """Daily windows when computing is allowed; no windows means always.

    Local wall-clock time, evaluated on whatever ``datetime`` the caller passes (naive
    or aware); on a DST change day a window follows the clock on the wall.
    """

    windows: tuple[Window, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """Parse "22:00-07:00, 12:00-13:30"; "" is always. ValueError if malformed."""
        windows: list[Window] = []
        for part in text.split(","):
            if not part.strip():
                continue
            start, sep, end = part.partition("-")
            if not sep:
                raise ValueError(f"{part.strip()!r} is not a window like 22:00-07:00")
            window = Window(_parse_clock(start, allow_24=False), _parse_clock(end, allow_24=True))
            if window.start_s == window.end_s:
                # Empty or all day? Ambiguous, so refused: "00:00-24:00" or "" say all day.
                raise ValueError(f"{part.strip()!r} starts and ends at the same time")
            windows.append(window)
        return cls(tuple(windows))

    @property
    def always(self) -> bool:
        return not self.windows

    def allows(self, now: datetime) -> bool:
        if self.always:
            return True
        second = now.hour * 3600 + now.minute * 60 + now.second + now.microsecond / 1e6
        return any(w.contains(second) for w in self.windows)

    def next_change(self, now: datetime) -> datetime | None:
        """The first boundary after ``now`` where ``allows`` flips; None if it never does."""
        if self.always:
            return None
        current = self.allows(now)
        midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
        edges = sorted(
            {
                midnight + timedelta(days=day, seconds=s)
                for day in (0, 1, 2)
                for w in self.windows
                for s in (w.start_s, w.end_s)
            }
        )
        for edge in edges:
            if edge > now and self.allows(edge) != current:
                return edge
        return None  # windows that together cover the whole day


# ---- snooze ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Snooze:
    """The owner said "not now" until ``until`` (local time); None: not snoozed."""

    until: datetime | None = None

    def active(self, now: datetime) -> bool:
        return self.until is not None and now < self.until

    @classmethod
    def for_duration(cls, now: datetime, duration: timedelta = timedelta(hours=1)) -> Snooze:
        """The "1 hour" button."""
        return cls(now + duration)

    @classmethod
    def until_tomorrow(cls, now: datetime) -> Snooze:
        """The "until tomorrow" button: the next local midnight.

        Midnight, not a morning hour: it is what "tomorrow" means on a calendar, needs no
        extra setting, and the schedule and idle rules still guard the night.
        """
        midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
        return cls(midnight + timedelta(days=1))

    @classmethod
    def from_iso(cls, text: str) -> Snooze:
        """The settings' ``snooze_until``; "" is not snoozed. ValueError if malformed."""
        return cls(datetime.fromisoformat(text) if text.strip() else None)

    def to_iso(self) -> str:
        return "" if self.until is None else self.until.isoformat(timespec="seconds")


def format_until(until: datetime, now: datetime) -> str:
    """As "15:40" today, "tomorrow 00:00", else "2024-05-03 09:00"."""
    clock = until.strftime("%H:%M")
    if until.date() == now.date():
        return clock
    if until.date() == now.date() + timedelta(days=1):
        return f"tomorrow {clock}"
    return f"{until:%Y-%m-%d} {clock}"


# ---- decision --------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyConfig:
    """The owner's rules, in the policy's own terms (see ``policy_runner.policy_config``)."""

    idle_only: bool = False
    idle_threshold_percent: float = 25.0
    idle_after_s: float = 300.0
    pause_on_battery: bool = True
    schedule: Schedule = field(default_factory=Schedule)
    snooze: Snooze = field(default_factory=Snooze)
    gpu_only_when_free: bool = False  # pause while another program keeps the GPU busy
    # Limits while idle, and while in use (0%: pause, as idle_only does). Threads 0:
    # leave the core's count alone; in-use threads 0: the same as ``threads``.
    cpu_percent: int = 100
    threads: int = 0
    in_use_cpu_percent: int = 100
    in_use_threads: int = 0
    # Pause above these, resume ``temp_hysteresis_c`` below them; 0: no limit.
    max_cpu_temp_c: float = 0.0
    max_gpu_temp_c: float = 0.0  # 0 as well when the worker does not use the GPU
    temp_hysteresis_c: float = 5.0

    def new_detector(self) -> IdleDetector:
        return IdleDetector(threshold=self.idle_threshold_percent, idle_after_s=self.idle_after_s)

    def new_guard(self) -> ThermalGuard:
        return ThermalGuard.with_limits(
            self.max_cpu_temp_c, self.max_gpu_temp_c, self.temp_hysteresis_c
        )

    def limits(self, *, idle: bool) -> Limits:
        """The in-use limits only ever tighten the idle ones: the lower of each applies.
        So the defaults (100%, the same threads) keep an owner's CPU-time limit in force
        while they use the computer, which is when it matters most. Where both sets come
        out the same (and being in use does not pause), the mode is "always": the status
        then names no mode that the owner never set apart."""
        threads = self.in_use_threads or self.threads
        if self.threads:
            threads = min(threads, self.threads)
        cpu_percent = min(self.in_use_cpu_percent, self.cpu_percent)
        if not self.idle_only and (cpu_percent, threads) == (self.cpu_percent, self.threads):
            return Limits(cpu_percent, threads, MODE_ALWAYS)
        if idle:
            return Limits(self.cpu_percent, self.threads, MODE_IDLE)
        return Limits(cpu_percent, threads, MODE_IN_USE)


@dataclass(frozen=True)
class Limits:
    """How hard to compute while allowed: ``WorkerCore.set_cpu_percent``/``set_threads``
    values and the mode's name for the status. ``cpu_percent`` 0 comes with an in-use
    pause and ``threads`` 0 means "leave as is": neither is sent to the core."""

    cpu_percent: int = 100
    threads: int = 0
    mode: str = MODE_ALWAYS


@dataclass(frozen=True)
class Decision:
    """Whether to compute now, and why, and the limits in force.

    ``reason`` is the short text for ``WorkerCore.pause`` (the coordinator sees it and
    the core shows "Paused: <reason>"); ``line`` is the status line for people. When
    ``run`` is True both are empty: the worker's own line ("Computing ...", "Waiting
    for tiles") says what it is doing. ``limits`` follow the in-use/idle mode even while
    paused, so that a resume starts with the right ones already in place.
    """

    run: bool
    reason_code: str
    line: str = ""
    reason: str = ""
    limits: Limits = field(default_factory=Limits)


ALLOWED = Decision(run=True, reason_code=RUN)


def decide(
    readings: Readings,
    now: datetime,
    config: PolicyConfig,
    *,
    idle: bool = True,
    too_hot: TempLimit | None = None,
) -> Decision:
    """Apply the owner's rules in priority order (module docstring) at local time ``now``.

    ``idle`` is the IdleDetector's current answer: it picks the limits, and pauses with
    ``idle_only`` or an in-use CPU share of 0. ``too_hot`` is the ThermalGuard's
    ``cause``: the guard, not this function, holds the hysteresis.
    """
    limits = config.limits(idle=idle)

    def paused(code: str, reason: str, line: str = "") -> Decision:
        return Decision(False, code, line or f"Paused: {reason}", reason, limits)

    if config.snooze.active(now):
        assert config.snooze.until is not None
        until = format_until(config.snooze.until, now)
        return paused(SNOOZED, f"snoozed until {until}", f"Snoozed until {until}")
    if config.pause_on_battery and readings.on_battery:
        return paused(ON_BATTERY, "on battery")
    if not config.schedule.allows(now):
        return paused(OUTSIDE_SCHEDULE, "outside schedule")
    if too_hot is not None and too_hot.hot:
        return paused(TOO_HOT, too_hot.text)
    # Unknown (None: no GPU, no NVML) never pauses: see client_app.gpu_busy.
    if config.gpu_only_when_free and readings.gpu_busy is True:
        return paused(GPU_BUSY, "graphics card in use")
    if not idle and (config.idle_only or limits.cpu_percent == 0):
        return paused(IN_USE, "computer in use")
    return Decision(True, RUN, limits=limits)


def decide_all(
    samples: Sequence[tuple[float, datetime, Readings]], config: PolicyConfig
) -> list[Decision]:
    """Decisions for a sequence of (monotonic t, local now, readings): what a runner
    would decide sample by sample. Handy for tests and for replaying a logged trace."""
    detector, guard = config.new_detector(), config.new_guard()
    out: list[Decision] = []
    for t, now, readings in samples:
        detector, guard = detector.observe(readings, t), guard.observe(readings, t)
        out.append(decide(readings, now, config, idle=detector.idle, too_hot=guard.cause))
    return out
