"""The Cleave worker: a GUI-agnostic core that joins a coordinator and computes tiles.

Layers, from pure to I/O:

- ``session``: the sans-I/O protocol state machine (bytes in -> actions out).
- ``compute``/``profile``: torch work and the device profile sent at join.
- ``worker``: the asyncio pump (``WorkerCore``) around one session, with reconnects.
- ``cli``: the headless ``cleave-worker`` command.

Qt is never imported here: a GUI (``client_app.gui``) observes ``WorkerCore`` through
``WorkerStatus`` snapshots and drives it with its thread-safe methods.
"""
