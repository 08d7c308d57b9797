"""``python -m client_app``: the same as the ``cleave-worker`` command."""

import sys

from client_app.cli import main

if __name__ == "__main__":
    sys.exit(main())
