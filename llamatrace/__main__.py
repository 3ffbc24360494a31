"""``python -m llamatrace`` — the same as the ``llamatrace`` command."""

import sys


def _fail(line: str) -> None:
    sys.stderr.write(f"error: {line}\n")
    sys.exit(2)


def _main() -> None:
    package = sys.modules.get(__package__ or "llamatrace")
    if getattr(package, "__file__", None) is None:
        # `llamatrace` resolved to a folder without __init__.py (a namespace package), such as a
        # clone of the repository in the current folder, and this file came from elsewhere
        where = next(iter(getattr(package, "__path__", [])), "llamatrace")
        _fail(f"`python -m llamatrace` found the folder {where!r} (a llamatrace checkout?) before the "
              f"installed package; run it from another folder, or use the `llamatrace` command")
    try:
        from llamatrace.cli import run
    except ModuleNotFoundError as exc:
        if (exc.name or "").startswith("llamatrace"):
            raise
        _fail(f"llamatrace's dependency {exc.name!r} is not installed in this Python ({sys.executable}); "
              f"install llamatrace with its dependencies: `pip install -e .` in the checkout, or "
              f"`bash scripts/setup.sh`")
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)
    run()


_main()
