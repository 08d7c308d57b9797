"""client_app.thermal: picking the CPU's figure out of psutil's table, NVML through a
fake module, and every failure reading as None (no sensors or GPU needed)."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest

from client_app import thermal
from client_app.readings import Sampler

Entry = namedtuple("Entry", "label current high critical")


def entries(*currents: Any) -> list[Entry]:
    return [Entry(f"Core {i}", c, 90.0, 100.0) for i, c in enumerate(currents)]


# ---- cpu_celsius -------------------------------------------------------------------------


def test_cpu_celsius_takes_the_hottest_entry_of_the_cpu_chip() -> None:
    assert thermal.cpu_celsius({"coretemp": entries(61.0, 74.5, 58.0)}) == 74.5


def test_cpu_celsius_prefers_the_cpu_package_over_other_chips() -> None:
    table = {
        "acpitz": entries(45.0),  # the board's zone: a fallback only
        "nvme": entries(80.0),  # not the CPU at all
        "k10temp": entries(66.0),
    }
    assert thermal.cpu_celsius(table) == 66.0
    assert thermal.cpu_celsius({"acpitz": entries(45.0), "nvme": entries(80.0)}) == 45.0


def test_cpu_celsius_skips_unwired_sensors_and_falls_through() -> None:
    table = {
        "coretemp": entries(0.0, 200.0, float("nan"), None, True),  # nothing plausible
        "cpu_thermal": entries(51.0),
    }
    assert thermal.cpu_celsius(table) == 51.0


@pytest.mark.parametrize("table", [{}, {"nvme": entries(40.0)}, {"coretemp": []}])
def test_cpu_celsius_is_none_without_a_cpu_chip(table: dict[str, list[Entry]]) -> None:
    assert thermal.cpu_celsius(table) is None


# ---- cpu_temperature_source ------------------------------------------------------------------


def test_cpu_source_reads_the_table_on_each_call() -> None:
    readings = iter([{"coretemp": entries(60.0)}, {"coretemp": entries(62.0)}])
    source = thermal.cpu_temperature_source(lambda: next(readings), platform="linux")
    assert source is not None and source() == 62.0


def test_cpu_source_that_starts_failing_reads_none() -> None:
    calls = {"n": 0}

    def flaky() -> dict[str, list[Entry]]:
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError("hwmon went away")
        return {"coretemp": entries(60.0)}

    source = thermal.cpu_temperature_source(flaky, platform="linux")
    assert source is not None and source() is None


def raises() -> Any:
    raise RuntimeError("no sensors here")


@pytest.mark.parametrize(
    ("sensors", "platform"),
    [
        (lambda: {}, "linux"),  # no chips
        (lambda: {"nvme": entries(40.0)}, "linux"),  # chips, none the CPU's
        (raises, "linux"),
        (lambda: None, "linux"),  # not a table at all
        (lambda: {"coretemp": entries(60.0)}, "win32"),  # psutil reads none there
        (lambda: {"coretemp": entries(60.0)}, "darwin"),
    ],
)
def test_no_cpu_source_where_nothing_can_be_read(sensors: Any, platform: str) -> None:
    source = thermal.cpu_temperature_source(sensors, platform=platform)
    assert source is None
    assert thermal.cpu_sensor_missing(source, platform)  # and a reason to show


def test_cpu_sensor_missing_says_why() -> None:
    assert thermal.cpu_sensor_missing(lambda: 50.0) == ""
    assert "lm-sensors" in thermal.cpu_sensor_missing(None, "linux")
    assert "does not let programs" in thermal.cpu_sensor_missing(None, "win32")


# ---- NVML --------------------------------------------------------------------------------


class FakeNvml:
    """The few pynvml calls thermal uses; ``fail`` names the call that raises."""

    NVML_TEMPERATURE_GPU = 0

    class NVMLError(Exception):
        pass

    def __init__(self, celsius: Any = 67, fail: str = "") -> None:
        self.celsius = celsius
        self.fail = fail
        self.inits = 0
        self.shutdowns = 0

    def _maybe_fail(self, name: str) -> None:
        if self.fail == name:
            raise self.NVMLError(name)

    def nvmlInit(self) -> None:
        self._maybe_fail("init")
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1
        self._maybe_fail("shutdown")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._maybe_fail("handle")
        return index

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> Any:
        assert sensor == self.NVML_TEMPERATURE_GPU
        self._maybe_fail("temperature")
        return self.celsius


def test_gpu_celsius_reads_and_shuts_nvml_down() -> None:
    nvml = FakeNvml(celsius=67)
    assert thermal.gpu_celsius(nvml) == 67.0
    assert (nvml.inits, nvml.shutdowns) == (1, 1)


@pytest.mark.parametrize("fail", ["handle", "temperature"])
def test_gpu_celsius_is_none_on_an_nvml_error_and_still_shuts_down(fail: str) -> None:
    nvml = FakeNvml(fail=fail)
    assert thermal.gpu_celsius(nvml) is None
    assert nvml.shutdowns == 1


def test_gpu_celsius_is_none_without_a_driver() -> None:
    nvml = FakeNvml(fail="init")
    assert thermal.gpu_celsius(nvml) is None
    assert nvml.shutdowns == 0  # nothing to shut down


def test_a_failing_shutdown_does_not_mask_the_reading() -> None:
    assert thermal.gpu_celsius(FakeNvml(celsius=70, fail="shutdown")) == 70.0


@pytest.mark.parametrize("celsius", [0, 255, "hot"])
def test_gpu_celsius_rejects_implausible_readings(celsius: Any) -> None:
    assert thermal.gpu_celsius(FakeNvml(celsius=celsius)) is None


def test_gpu_source_reads_on_each_call() -> None:
    nvml = FakeNvml(celsius=60)
    source = thermal.gpu_temperature_source(nvml)
    assert source is not None
    nvml.celsius = 75
    assert source() == 75.0
    nvml.fail = "temperature"
    assert source() is None  # a failure later reads as unknown, not an exception


def test_no_gpu_source_without_a_readable_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert thermal.gpu_temperature_source(FakeNvml(fail="init")) is None
    monkeypatch.setattr(thermal.gpu_busy, "load_nvml", lambda: None)  # nvidia-ml-py not installed
    assert thermal.gpu_temperature_source() is None


def test_gpu_sensor_missing_says_why() -> None:
    assert thermal.gpu_sensor_missing(lambda: 50.0, gpu_present=True) == ""
    assert "nvidia-ml-py" in thermal.gpu_sensor_missing(None, gpu_present=True)
    assert "no graphics card" in thermal.gpu_sensor_missing(None, gpu_present=False)


# ---- through the Sampler -----------------------------------------------------------------------


def test_sampler_turns_failing_temperature_sources_into_none() -> None:
    sample = Sampler(cpu=lambda: 1.0, battery=lambda: None, cpu_temp=raises, gpu_temp=raises)()
    assert (sample.cpu_temp_c, sample.gpu_temp_c) == (None, None)


def test_sampler_reads_both_temperatures() -> None:
    nvml = FakeNvml(celsius=66)
    cpu = thermal.cpu_temperature_source(lambda: {"coretemp": entries(55.0)}, platform="linux")
    sample = Sampler(
        cpu=lambda: 1.0,
        battery=lambda: None,
        cpu_temp=cpu,
        gpu_temp=thermal.gpu_temperature_source(nvml),
    )()
    assert (sample.cpu_temp_c, sample.gpu_temp_c) == (55.0, 66.0)


def test_this_machine_reads_a_temperature_or_none() -> None:
    sample = Sampler.for_this_machine()()
    for celsius in (sample.cpu_temp_c, sample.gpu_temp_c):
        assert celsius is None or 0.0 < celsius < 150.0
