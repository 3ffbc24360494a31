"""The ``llamatrace`` command line: thin commands that parse options, call the library, print.

``app.py`` holds the typer app and maps errors to exit codes; ``options.py`` the options and
helpers every command shares; ``progress.py`` the progress of a long job in units (a bar, or lines
in a log); each command is a module of its own that registers on the app.
Importing this package registers them all, in the order ``--help`` lists them.
"""

# The CLI is llamatrace's own process: Numba runs with llamatrace's settings (OpenMP first, a
# short OpenMP spin, its cache folder), set before any command imports Numba.
from llamatrace.machine.runtime import configure_process

configure_process()

from llamatrace.cli.app import (  # noqa: E402
    EXIT_BAD_INPUT,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    app,
    main,
)

# the import order is the order `llamatrace --help` lists the commands
from llamatrace.cli import generate  # noqa: E402,F401,I001  (isort: skip)
from llamatrace.cli import trace  # noqa: E402,F401,I001  (isort: skip)
from llamatrace.cli import diagram  # noqa: E402,F401,I001  (isort: skip)
from llamatrace.cli import attention  # noqa: E402,F401,I001  (isort: skip)
from llamatrace.cli import state  # noqa: E402,F401,I001  (isort: skip)
from llamatrace.cli import lens  # noqa: E402,F401,I001  (isort: skip)
from llamatrace.cli import experts  # noqa: E402,F401,I001  (isort: skip)
from llamatrace.cli import stages  # noqa: E402,F401,I001  (isort: skip)
from llamatrace.cli import info  # noqa: E402,F401,I001  (isort: skip)
from llamatrace.cli import compare  # noqa: E402,F401,I001  (isort: skip)
from llamatrace.cli import bench  # noqa: E402,F401,I001  (isort: skip)
from llamatrace.cli import perplexity  # noqa: E402,F401,I001  (isort: skip)
from llamatrace.cli import imatrix  # noqa: E402,F401,I001  (isort: skip)
from llamatrace.cli import collect  # noqa: E402,F401,I001  (isort: skip)
from llamatrace.cli import quantize  # noqa: E402,F401,I001  (isort: skip)
from llamatrace.cli import pull  # noqa: E402,F401,I001  (isort: skip)

__all__ = ["app", "main", "EXIT_OK", "EXIT_INTERNAL", "EXIT_BAD_INPUT", "EXIT_INTERRUPTED"]
