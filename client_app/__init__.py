"""The Cleave worker: a GUI-agnostic core that joins a coordinator and computes tiles.

Layers, from pure to I/O:

- ``session``: the sans-I/O protocol state machine (bytes in -> actions out).
- ``compute``/``profile``: torch work and the device profile sent at join.
- ``duty``/``bandwidth``: the owner's limits as pure controllers; ``pacing`` turns them
  into waits, ``charging`` measures what a tile costs the CPU-time limit.
- ``worker``: the asyncio pump (``WorkerCore``) around one session, with reconnects; it
  takes a ``WorkerOptions`` (``options``) and reports through ``status_board``.
- ``cli``: the headless ``cleave-worker`` command.

Qt is never imported here: a GUI (``client_app.gui``) observes ``WorkerCore`` through
``WorkerStatus`` snapshots and drives it with its thread-safe methods.
"""
