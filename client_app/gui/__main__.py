"""``python -m client_app.gui``: the same as ``cleave-app``."""

import sys

from client_app.gui.app import main

sys.exit(main())
