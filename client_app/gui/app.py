"""``cleave-app [--coordinator URL] [--join] [--minimized] [--self-test]``: the desktop app.

Settings live in the same ``settings.json`` as ``cleave-worker``'s (``config_dir()``),
so either program picks up where the other left off.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import PySide6
from PySide6.QtCore import QTimer, qVersion
from PySide6.QtWidgets import QApplication

from client_app.config import WorkerSettings, config_dir
from client_app.gui.main_window import MainWindow
from client_app.self_test import run_self_test, verdict
from common.errors import ConfigError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cleave-app", description="Donate this machine's CPU/GPU time to Cleave."
    )
    parser.add_argument(
        "--coordinator", metavar="URL", help="coordinator URL, e.g. ws://host:8765/ws (saved)"
    )
    parser.add_argument("--join", action="store_true", help="join at once")
    parser.add_argument(
        "--minimized", action="store_true", help="start in the tray (if the desktop has one)"
    )
    parser.add_argument(
        "--self-test",
        action="store_true",
        help="compute a test tile, check it against torch, build the window unseen, and exit "
        "0 if all is well (for installers and support)",
    )
    return parser


def load_settings(args: argparse.Namespace) -> tuple[WorkerSettings, str]:
    """Saved settings with ``--coordinator`` applied, and a warning to show (or "")."""
    directory = config_dir()
    warning = ""
    try:
        settings = WorkerSettings.load(directory)
    except ConfigError as exc:
        # The app must still open so the owner can fix things; the file is left alone
        # until they change a setting.
        warning = str(exc)
        settings = WorkerSettings()
    if args.coordinator:
        settings = replace(settings, coordinator_url=args.coordinator)
        if not warning:
            settings.save(directory)
    return settings, warning


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
    )
    logging.getLogger("websockets").setLevel(logging.INFO)
    if args.self_test:
        return self_test()
    app = QApplication.instance() or QApplication(sys.argv[:1])
    assert isinstance(app, QApplication)
    app.setApplicationName("Cleave")
    settings, warning = load_settings(args)
    window = MainWindow(settings, config_dir())
    # With a tray, closing the window keeps the worker running; Quit is the way out.
    app.setQuitOnLastWindowClosed(not window.tray.available)
    window.quit_done.connect(app.quit)
    # Reached also when Qt quits on its own (last window closed, session end): the
    # coordinator should still get its Bye.
    app.aboutToQuit.connect(window.shutdown)
    if warning:
        window.status_label.setText(f"Settings not loaded: {warning}")
    # getattr: "start minimised" is a setting newer than this window's first version.
    minimized = args.minimized or bool(getattr(settings, "start_minimized", False))
    if not (minimized and window.tray.available):
        window.show()
    if args.join and settings.coordinator_url:
        window.join()
    # Ctrl-C / SIGTERM quit as the tray's Quit does: leave first. Python runs signal
    # handlers only between bytecodes, so an idle timer gives it the chance while Qt waits.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: window.quit())
    wakeup = QTimer()
    wakeup.timeout.connect(lambda: None)
    wakeup.start(250)
    return int(app.exec())


def self_test() -> int:
    """The worker path's check, then proof that Qt and the window come up; exit status."""
    report = run_self_test()
    for line in report.lines():
        print(line, flush=True)
    qt_ok = qt_self_test()
    ok = report.ok and qt_ok
    print(verdict(ok))
    return 0 if ok else 1


def qt_self_test() -> bool:
    """Build the main window unseen and close it again; prints what it found."""
    # Without a display Qt would abort the process before printing anything useful; a
    # headless self-test (an installer, CI) still proves the widgets load offscreen.
    if sys.platform.startswith("linux") and not (
        os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")
    ):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    try:
        app = QApplication.instance() or QApplication(sys.argv[:1])
        assert isinstance(app, QApplication)
        # A throwaway config directory: the check must not touch the owner's settings,
        # pins or history.
        with tempfile.TemporaryDirectory(prefix="cleave-self-test-") as directory:
            window = MainWindow(WorkerSettings(), Path(directory))
            window.quit()  # not joined: nothing to leave, and closing is then accepted
            window.shutdown()
            window.close()
            window.deleteLater()
            app.processEvents()
    except Exception as exc:
        print(f"qt: FAILED: {type(exc).__name__}: {exc}")
        return False
    print(
        f"qt: PySide6 {PySide6.__version__} (Qt {qVersion()}), platform "
        f"{app.platformName()}: main window built and closed"
    )
    return True
