"""The coordinator's WebSocket connection: a large frame's payload is sent from the
buffer it was given and received straight into a buffer of its size.

websockets copies every frame it sends and receives, more than once; for the operand
blocks that tasks carry and the results that come back, those are copies on the event
loop of every byte. ``common.frame_writes`` writes a task's head and operand blocks as
one frame from where they lie, and ``common.frame_reads`` reads a result's payload
straight into its own buffer, as on the worker's end.
"""

from __future__ import annotations

from websockets.asyncio.server import ServerConnection

from common.frame_reads import FrameReads
from common.frame_writes import FrameWrites


class ZeroCopyConnection(FrameReads, FrameWrites, ServerConnection):
    """``serve(create_connection=ZeroCopyConnection)``."""
