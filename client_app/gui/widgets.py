"""Small building blocks the window's panels share: fonts relative to a base font, and
labels for text that may come from the coordinator."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QFont
from PySide6.QtWidgets import QLabel


def scaled_font(base: QFont, factor: float, *, bold: bool = False) -> QFont:
    """``base`` times ``factor``: relative sizes keep the window's proportions at any
    system font size or display scale."""
    font = QFont(base)
    if font.pointSizeF() > 0:
        font.setPointSizeF(font.pointSizeF() * factor)
    else:  # a font set in pixels
        font.setPixelSize(max(1, round(font.pixelSize() * factor)))
    font.setBold(bold)
    return font


def plain_label(font: QFont | None = None, *, wrap: bool = True) -> QLabel:
    """A label for text that may come from the coordinator: never interpreted as HTML,
    selectable, wrapped unless it is one unbreakable token (a key)."""
    label = QLabel()
    label.setTextFormat(Qt.TextFormat.PlainText)
    label.setWordWrap(wrap)
    label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    if font is not None:
        label.setFont(font)
    return label
