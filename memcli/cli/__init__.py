"""The `memcli` command line: one thin typer function per command, registered in `app.py`.

`main` imports the app lazily, so that importing a command module never imports the app
back (the app imports the commands, never the reverse).
"""


def main() -> None:
    from memcli.cli.app import app

    app()
