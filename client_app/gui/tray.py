"""The tray icon: Join / Pause / Snooze 1 hour / Open / Quit, its colour showing the state.

Icons are drawn with QPainter (no image files to ship). Offscreen or on a desktop
without a tray the icon is absent, but the menu's actions exist all the same, so the
window and tests can use one code path.
"""

from __future__ import annotations

import sys

from PySide6.QtCore import QObject, QPointF, QRectF, Qt, Signal
from PySide6.QtGui import QAction, QBrush, QColor, QIcon, QPainter, QPen, QPixmap
from PySide6.QtWidgets import QMenu, QSystemTrayIcon

from client_app.gui.status_text import (
    NOT_JOINED,
    STATE_COLOURS,
    html_for_plain,
    shown_state,
    tray_tooltip,
)
from client_app.status import WorkerStatus

ICON_SIZE = 64


def icon_tooltip(text: str, platform: str | None = None) -> str:
    """``text`` as the tray icon must be given it to show it literally.

    Windows and macOS show tray tooltips as plain text. Elsewhere Qt (an XEmbed tray)
    or the desktop (StatusNotifierItem) guesses whether a tooltip is HTML, and a job
    name is the coordinator's text: as escaped HTML it shows exactly the characters it
    was sent, "<b>" included.
    """
    plat = sys.platform if platform is None else platform
    if plat.startswith(("win", "darwin")):
        return text
    return html_for_plain(text)


def state_icon(state: str, size: int = ICON_SIZE) -> QIcon:
    """A filled disc in the state's colour with a glyph: play, pause bars, or a dot."""
    pixmap = QPixmap(size, size)
    pixmap.fill(Qt.GlobalColor.transparent)
    painter = QPainter(pixmap)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    colour = QColor(STATE_COLOURS.get(state, STATE_COLOURS["stopped"]))
    painter.setPen(QPen(colour.darker(140), size / 16))
    painter.setBrush(QBrush(colour))
    margin = size / 16
    painter.drawEllipse(QRectF(margin, margin, size - 2 * margin, size - 2 * margin))
    painter.setPen(Qt.PenStyle.NoPen)
    painter.setBrush(QBrush(QColor("white")))
    s = size / 64  # the glyphs are laid out on a 64-unit grid
    if state == "computing":
        play = [QPointF(26 * s, 18 * s), QPointF(26 * s, 46 * s), QPointF(48 * s, 32 * s)]
        painter.drawPolygon(play)
    elif state in ("paused", "snoozed"):
        painter.drawRect(QRectF(22 * s, 20 * s, 7 * s, 24 * s))
        painter.drawRect(QRectF(35 * s, 20 * s, 7 * s, 24 * s))
    elif state == "refused":
        painter.drawRect(QRectF(18 * s, 28 * s, 28 * s, 8 * s))
    else:
        painter.drawEllipse(QRectF(25 * s, 25 * s, 14 * s, 14 * s))
    painter.end()
    return QIcon(pixmap)


class Tray(QObject):
    """The tray's menu as actions plus, where the desktop has a tray, the icon itself."""

    join_toggled = Signal()  # "Join" or "Leave", whichever the menu shows
    pause_toggled = Signal(bool)
    snooze_requested = Signal()
    open_requested = Signal()
    quit_requested = Signal()

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.menu = QMenu()
        self.join_action = QAction("Join", self)
        self.pause_action = QAction("Pause", self)
        self.pause_action.setCheckable(True)
        self.snooze_action = QAction("Snooze 1 hour", self)
        self.open_action = QAction("Open", self)
        self.quit_action = QAction("Quit", self)
        self.join_action.triggered.connect(self.join_toggled)
        self.pause_action.toggled.connect(self.pause_toggled)
        self.snooze_action.triggered.connect(self.snooze_requested)
        self.open_action.triggered.connect(self.open_requested)
        self.quit_action.triggered.connect(self.quit_requested)
        for action in (self.join_action, self.pause_action, self.snooze_action):
            self.menu.addAction(action)
        self.menu.addSeparator()
        self.menu.addAction(self.open_action)
        self.menu.addAction(self.quit_action)
        self.state = "stopped"
        self.tooltip = tray_tooltip(NOT_JOINED)  # plain text: what the icon's tooltip says
        self.icon: QSystemTrayIcon | None = None
        if QSystemTrayIcon.isSystemTrayAvailable():
            self.icon = QSystemTrayIcon(state_icon(self.state), self)
            self.icon.setContextMenu(self.menu)
            self.icon.activated.connect(self._on_activated)
            self.icon.setToolTip(icon_tooltip(self.tooltip))
            self.icon.show()

    @property
    def available(self) -> bool:
        """Whether a tray icon is shown (if not, closing the window must quit)."""
        return self.icon is not None

    def update_status(self, status: WorkerStatus, joined: bool) -> None:
        self.state = shown_state(status)
        self.join_action.setText("Leave" if joined else "Join")
        self.tooltip = tray_tooltip(status)
        if self.icon is not None:
            self.icon.setIcon(state_icon(self.state))
            self.icon.setToolTip(icon_tooltip(self.tooltip))

    def _on_activated(self, reason: QSystemTrayIcon.ActivationReason) -> None:
        if reason == QSystemTrayIcon.ActivationReason.Trigger:
            self.open_requested.emit()
