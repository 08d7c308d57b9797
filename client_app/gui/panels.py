"""The main window's panels, top to bottom: the job, the state as one sentence, this
session's contribution, and the connection with its controls.

Each panel builds its widgets and shows its part of a ``WorkerStatus``; the window
composes them and wires their buttons. Fonts scale the window's font, passed in as
``base_font``, because a group box or a button may have a platform font of its own.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QFont, QPixmap
from PySide6.QtWidgets import (
    QFormLayout,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
)

from client_app.gui.status_text import (
    breakable,
    clean_text,
    html_for_plain,
    job_about,
    limits_line,
    progress_text,
    rank_text,
    status_line,
)
from client_app.gui.units import format_count, format_duration, format_gflop
from client_app.gui.widgets import plain_label, scaled_font
from client_app.status import WorkerStatus

JOIN_TEXT = "&Join"  # Alt+J
LEAVE_TEXT = "&Leave"  # Alt+L

# Key, caption, tooltip of each big number in the contribution panel.
CONTRIBUTION_FIGURES: tuple[tuple[str, str, str], ...] = (
    ("tiles", "tiles computed", "Pieces of work this computer finished."),
    ("verified", "verified", "Work the coordinator checked and accepted, from its ledger."),
    ("time", "time computing", "Time spent multiplying matrices."),
)


class JobPanel(QGroupBox):
    """The job this computer helps: name, description, who runs it, its page, and the
    key its coordinator signs with."""

    def __init__(self, base_font: QFont) -> None:
        super().__init__("What this computer helps")
        column = QVBoxLayout(self)
        self.name_label = plain_label(scaled_font(base_font, 1.35, bold=True))
        self.name_label.setAccessibleName("Training job")
        self.description_label = plain_label()
        self.description_label.setAccessibleName("Job description")
        self.meta_label = plain_label()  # "Run by ... · 124 M parameters"
        self.meta_label.setAccessibleName("Who runs the job, and the model's size")
        self.link_label = plain_label()  # text only: a stranger's link is not clicked
        self.link_label.setAccessibleName("The job's web page")
        for label in (self.name_label, self.description_label, self.meta_label, self.link_label):
            column.addWidget(label)
        key_row = QHBoxLayout()
        key_caption = QLabel("Coordinator key:")
        self.fingerprint_label = plain_label(wrap=False)
        self.fingerprint_label.setAccessibleName("Coordinator key")
        self.fingerprint_label.setToolTip(
            "The fingerprint of the key this coordinator signs its work with. It is "
            "remembered at the first join; a different key later stops the app."
        )
        key_row.addWidget(key_caption)
        key_row.addWidget(self.fingerprint_label, 1)
        column.addLayout(key_row)

    def show_status(self, status: WorkerStatus) -> None:
        about = job_about(status)
        fp = status.coordinator_fingerprint
        self.fingerprint_label.setText(fp + rank_text(status, " · ") if fp else "not known yet")
        if not about.name:
            self.name_label.setText("No job yet")
            self.description_label.setText(
                "Join a coordinator to see the training job this computer helps."
            )
            self.description_label.show()
            for label in (self.meta_label, self.link_label):
                label.hide()
            return
        self.name_label.setText(breakable(about.name))
        # The step is here as well as in the sentence: it stays in view between tiles.
        meta = " · ".join(
            part
            for part in (
                f"Run by {about.operator}" if about.operator else "",
                about.size,
                progress_text(status),
            )
            if part
        )
        for label, text in (
            (self.description_label, about.description),
            (self.meta_label, meta),
            (self.link_label, about.link),
        ):
            label.setText(breakable(text))
            label.setVisible(bool(text))


class StateRow(QHBoxLayout):
    """The state icon beside the state as one sentence and the limits in force.

    A layout rather than a widget: its labels sit directly in the window's column,
    spaced like the panels around them.
    """

    def __init__(self, base_font: QFont) -> None:
        super().__init__()
        self.icon_label = QLabel()
        self.icon_label.setAccessibleName("State icon")
        self.addWidget(self.icon_label, 0, Qt.AlignmentFlag.AlignTop)
        column = QVBoxLayout()
        self.status_label = plain_label(scaled_font(base_font, 1.5, bold=True))
        self.status_label.setAccessibleName("State")
        self.limits_label = plain_label()
        self.limits_label.setAccessibleName("Limits in force")
        column.addWidget(self.status_label)
        column.addWidget(self.limits_label)
        self.addLayout(column, 1)

    def show_status(self, status: WorkerStatus, icon: QPixmap) -> None:
        self.status_label.setText(breakable(status_line(status)))
        self.status_label.setToolTip(html_for_plain(status.detail or status.line))
        limits = limits_line(status)
        self.limits_label.setText(limits)
        self.limits_label.setVisible(bool(limits))
        self.icon_label.setPixmap(icon)


class ContributionPanel(QGroupBox):
    """This session's contribution in big numbers, each over its caption."""

    def __init__(self, base_font: QFont) -> None:
        super().__init__("This session")
        grid = QGridLayout(self)
        big = scaled_font(base_font, 1.8, bold=True)
        self.values: dict[str, QLabel] = {}
        self.captions: dict[str, QLabel] = {}
        for col, (key, caption, tip) in enumerate(CONTRIBUTION_FIGURES):
            value = QLabel()
            value.setFont(big)
            value.setAlignment(Qt.AlignmentFlag.AlignCenter)
            value.setAccessibleName(caption.capitalize())
            value.setToolTip(tip)
            value.setTextFormat(Qt.TextFormat.PlainText)
            value.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            note = QLabel(caption)
            note.setAlignment(Qt.AlignmentFlag.AlignCenter)
            note.setToolTip(tip)
            note.setWordWrap(True)
            grid.addWidget(value, 0, col)
            grid.addWidget(note, 1, col)
            grid.setColumnStretch(col, 1)
            self.values[key] = value
            self.captions[key] = note

    def show_status(self, status: WorkerStatus) -> None:
        self.values["tiles"].setText(format_count(status.tiles_done))
        self.values["verified"].setText(format_gflop(status.credit_gflop))
        self.captions["verified"].setText(f"verified ({format_count(status.credit_tiles)} tiles)")
        self.values["time"].setText(format_duration(status.compute_s))


class ConnectionPanel(QGroupBox):
    """The coordinator URL with Join/Leave, this computer's key, the tile in progress,
    the app's own CPU and GPU use, and the Settings button."""

    def __init__(
        self, base_font: QFont, *, url: str, identity: str, settings_available: bool
    ) -> None:
        super().__init__("Connection")
        form = QFormLayout(self)
        form.setRowWrapPolicy(QFormLayout.RowWrapPolicy.WrapLongRows)
        self.url_edit = QLineEdit(url)
        self.url_edit.setPlaceholderText("ws://host:8765/ws")
        self.url_edit.setAccessibleName("Coordinator URL")
        self.join_button = QPushButton(JOIN_TEXT)
        self.join_button.setFont(scaled_font(base_font, 1.25, bold=True))
        self.join_button.setDefault(True)  # Enter in the URL field joins
        self.join_button.setAccessibleName("Join or leave the coordinator")
        url_row = QHBoxLayout()
        url_row.addWidget(self.url_edit, 1)
        url_row.addWidget(self.join_button)
        url_label = QLabel("Coordinator &URL:")
        url_label.setBuddy(self.url_edit)
        form.addRow(url_label, url_row)

        # This computer's identity: credit and reputation follow it, and operators see
        # it next to the name on their dashboard.
        self.identity_label = plain_label(wrap=False)
        self.identity_label.setText(identity)
        self.identity_label.setAccessibleName("Your key")
        form.addRow("Your key:", self.identity_label)

        # A GEMM is one call with no progress of its own: the bar is busy while a tile
        # computes, and names it.
        tile_row = QHBoxLayout()
        self.tile_label = plain_label(wrap=False)
        self.tile_bar = QProgressBar()
        self.tile_bar.setTextVisible(False)  # a busy bar draws no text in most styles
        self.tile_bar.setAccessibleName("Tile progress")
        tile_row.addWidget(self.tile_label)
        tile_row.addWidget(self.tile_bar, 1)
        form.addRow("Tile:", tile_row)

        usage_row = QHBoxLayout()
        self.usage_label = QLabel("CPU 0%")
        self.settings_button = QPushButton("&Settings…")
        self.settings_button.setAccessibleName("Settings")
        usage_row.addWidget(self.usage_label, 1)
        usage_row.addWidget(self.settings_button)
        form.addRow("This app:", usage_row)
        # Once in the box: shown while still without a parent it would open as a window.
        self.settings_button.setVisible(settings_available)

    def show_status(self, status: WorkerStatus, *, joined: bool, leaving: bool) -> None:
        if leaving:
            self.join_button.setText("Leaving…")
            self.join_button.setEnabled(False)
        else:
            self.join_button.setText(LEAVE_TEXT if joined else JOIN_TEXT)
            self.join_button.setEnabled(True)
        self.url_edit.setEnabled(not joined)
        if status.state == "computing" and status.current_tile:
            self.tile_bar.setRange(0, 0)  # busy
            self.tile_label.setText(clean_text(status.current_tile, 60))
        else:
            self.tile_bar.setRange(0, 1)
            self.tile_bar.setValue(0)
            self.tile_label.setText("none")
