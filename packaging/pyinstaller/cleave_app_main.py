"""The frozen bundle's entry point: ``cleave-app`` as PyInstaller runs it.

A script, not the ``client_app.gui.app:main`` entry point, because PyInstaller
analyses a file; it does exactly what the pip-installed ``cleave-app`` script does.
"""

import multiprocessing
import sys

from client_app.gui.app import main

if __name__ == "__main__":
    # A frozen program that starts a child process (torch and multiprocessing can)
    # would otherwise run the whole app again in the child.
    multiprocessing.freeze_support()
    sys.exit(main())
