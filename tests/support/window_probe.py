"""Lay out the app's main window with a job on show and print what a person would see,
as JSON: the Qt platform, the scale, the window's size, and every visible label's text
and whether it is cut off. Run under a platform (offscreen, or xcb on an X server) and a
``QT_SCALE_FACTOR`` chosen by the caller (tests/gui/test_gui_app.py), in a process of its own
because both are fixed when Qt starts."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

# The tests' folder (for support.*) and the checkout (for an uninstalled client_app).
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]

from PySide6.QtWidgets import QApplication, QLabel, QPushButton  # noqa: E402

from client_app.config import WorkerSettings  # noqa: E402
from support.sample_status import JOB_STATUS  # noqa: E402


def cut_off(widget: QLabel | QPushButton) -> bool:
    """Narrower (or, wrapping, shorter) than its text needs."""
    wraps = isinstance(widget, QLabel) and widget.wordWrap()
    hint = widget.minimumSizeHint() if wraps else widget.sizeHint()
    if widget.width() < hint.width():
        return True
    return wraps and widget.height() < widget.heightForWidth(widget.width()) - 1


def main() -> int:
    # The caller's directory, so that every probe shows the same worker key.
    os.environ.setdefault("CLEAVE_CONFIG_DIR", tempfile.mkdtemp(prefix="cleave-probe-"))
    app = QApplication(sys.argv[:1])
    from client_app.gui.main_window import MainWindow

    window = MainWindow(WorkerSettings(), Path(os.environ["CLEAVE_CONFIG_DIR"]))
    # No tile in progress: a busy bar's animation would draw differently in each run.
    window.show_status(replace(JOB_STATUS, current_tile=""))
    window.show()
    for _ in range(5):
        app.processEvents()
    picture = window.grab()  # lays everything out, as painting would
    if len(sys.argv) > 1:
        picture.save(sys.argv[1])  # device pixels: twice the size at a scale of 2
    widgets: list[QLabel | QPushButton] = [*window.findChildren(QLabel)]
    widgets += window.findChildren(QPushButton)
    shown = [w for w in widgets if w.isVisibleTo(window) and w.text()]
    print(
        json.dumps(
            {
                "platform": app.platformName(),
                "pixel_ratio": window.devicePixelRatio(),
                "size": [window.width(), window.height()],
                "texts": sorted(w.text() for w in shown),
                "cut_off": sorted(w.text() for w in shown if cut_off(w)),
            }
        )
    )
    window.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
