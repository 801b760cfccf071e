"""Which commands read a config: exactly those that take --config and --set, and the README
names exactly those."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from memcli.cli.app import COMMANDS, app
from memcli.cli.guard import CONFIG_COMMANDS

README = Path(__file__).resolve().parents[1] / "README.md"


def _options(command: str) -> set[str]:
    group = typer.main.get_command(app)
    *groups, name = command.split()
    for sub in groups:
        group = group.commands[sub]
    click_command = group.commands[name]
    return {opt for param in click_command.params for opt in param.opts}


def _commands_with_config() -> set[str]:
    names = [name for name, _, _ in COMMANDS] + ["reference diff"]
    with_config = {name for name in names if {"--config", "--set"} <= _options(name)}
    without = {name for name in names if not {"--config", "--set"} & _options(name)}
    assert with_config | without == set(names)  # none takes one flag without the other
    return with_config


def _listed(text: str) -> set[str]:
    return set(re.findall(r"`([a-z -]+)`", text))


def test_the_readme_names_exactly_the_commands_that_read_a_config():
    sentence = re.search(r"take `--config FILE` and `--set section\.key=value`: exactly\s+(.*?)\.", README.read_text(),
                         re.S).group(1)
    assert _listed(sentence) == _commands_with_config() == {"show-config", "bench-one-batch", "check-page-size",
                                                            "replay", "reference diff"}


def test_the_hint_for_config_on_other_commands_names_them():
    assert _listed("`" + CONFIG_COMMANDS.replace(", ", "` `").replace(" and ", "` `") + "`") == _commands_with_config()


@pytest.mark.parametrize("args", [["gen-trace", "t.jsonl", "--config", "c.yaml"],
                                  ["bench-radix", "--set", "memory.page_size=16"]])
def test_config_on_a_command_without_one_says_so(args):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    error, hint = result.stderr.splitlines()[:2]
    assert error.startswith("error: No such option: --")
    assert hint.startswith(f"hint: memcli {args[0]} reads no config; show-config,")
