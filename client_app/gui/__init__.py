"""``cleave-app``: the desktop app, thin Qt views over the Qt-free worker core.

Only this package may import Qt (napari's rule, checked by tests/loopback/test_worker_cli.py):
the worker, its policy and its settings live in ``client_app`` and know nothing of it.
"""
