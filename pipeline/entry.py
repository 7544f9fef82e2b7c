"""The ``kiln`` command's entry point: the CLI, or one line saying what to install where the command's own
dependencies are missing (the runtime installed alone, docs/embedding.md)."""

from __future__ import annotations

import sys


def main() -> None:
    """Run the ``kiln`` CLI; exit 2 naming the missing package when the install has no command line (whose
    ``kiln --version`` still answers)."""
    try:
        from kiln.pipeline.cli import main as cli_main
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] == "kiln":
            raise
        if sys.argv[1:] == ["--version"]:
            from kiln.runtime.version import version_line

            print(version_line())
            return
        print(f"error: the kiln command needs Kiln's dependencies ({exc.name} is missing): install Kiln with them "
              "(its wheel or checkout without --no-deps); the runtime installed alone has no command line",
              file=sys.stderr)
        sys.exit(2)
    cli_main()
