"""The `memcli` command line: one thin typer function per command, registered in `app.py`.

`main` imports the app lazily, so that importing a command module never imports the app
back (the app imports the commands, never the reverse). Ctrl-C while importing (torch takes
seconds) ends like any other interruption: one line and exit 130.
"""

import sys


def main() -> None:
    try:
        from memcli.cli.app import app
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    app()
