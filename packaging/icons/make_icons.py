"""Write the app icon: ``cleave.svg`` and its 256x256 render ``cleave-256.png``.

The icon is the tray's "computing" icon (``client_app.gui.tray.state_icon``): a green
disc with a darker rim and a white play glyph, on the same 64-unit grid, so the
launcher and the tray look like one app. Both files are committed; run this again
after changing the tray's look:

    QT_QPA_PLATFORM=offscreen .venv/bin/python packaging/icons/make_icons.py
"""

from __future__ import annotations

import sys
from pathlib import Path

from PySide6.QtCore import QByteArray, Qt
from PySide6.QtGui import QColor, QGuiApplication, QImage, QPainter
from PySide6.QtSvg import QSvgRenderer

from client_app.gui.status_text import STATE_COLOURS

HERE = Path(__file__).resolve().parent
PNG_SIZE = 256


def icon_svg() -> str:
    """The tray's computing icon as SVG (the tray draws it with QPainter at 64 px)."""
    fill = QColor(STATE_COLOURS["computing"])
    rim = fill.darker(140)  # as state_icon's pen
    # state_icon: margin size/16 = 4, pen size/16 = 4, play glyph (26,18)-(26,46)-(48,32).
    return f"""<?xml version="1.0" encoding="UTF-8"?>
<svg xmlns="http://www.w3.org/2000/svg" width="64" height="64" viewBox="0 0 64 64">
  <title>Cleave</title>
  <circle cx="32" cy="32" r="28" fill="{fill.name()}" stroke="{rim.name()}" stroke-width="4"/>
  <polygon points="26,18 26,46 48,32" fill="#ffffff"/>
</svg>
"""


def render_png(svg: str, size: int) -> QImage:
    renderer = QSvgRenderer(QByteArray(svg.encode("utf-8")))
    if not renderer.isValid():
        raise ValueError("the icon SVG does not parse")
    image = QImage(size, size, QImage.Format.Format_ARGB32)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    renderer.render(painter)
    painter.end()
    return image


def main() -> int:
    _app = QGuiApplication(sys.argv[:1])  # QImage text/SVG rendering needs one
    svg = icon_svg()
    (HERE / "cleave.svg").write_text(svg, encoding="utf-8")
    if not render_png(svg, PNG_SIZE).save(str(HERE / f"cleave-{PNG_SIZE}.png")):
        print("could not write the PNG", file=sys.stderr)
        return 1
    print(f"wrote {HERE / 'cleave.svg'} and {HERE / f'cleave-{PNG_SIZE}.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
