"""`--help` of every command: fast (no torch, triton or numpy imported for it) and readable
(plain metavars, no `<bool>`, one-line summaries that are whole sentences)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from memcli.cli.app import COMMANDS, app

HEAVY = ("torch", "triton", "numpy")
COMMAND_PATHS = [[], *([name] for name, _, _ in COMMANDS), ["reference"], ["reference", "fetch"],
                 ["reference", "diff"]]

# Runs command lines in one fresh interpreter, in order, and records which heavy modules were
# loaded after each.
PROBE = """
import json, sys
from memcli.cli.app import app
out = {}
for args in json.loads(sys.argv[1]):
    try:
        app(args, prog_name="memcli")
    except SystemExit:
        pass
    out[" ".join(args)] = [m for m in json.loads(sys.argv[2]) if m in sys.modules]
print("PROBE " + json.dumps(out))
"""


def _probe(command_lines: list[list[str]]) -> dict[str, list[str]]:
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(command_lines), json.dumps(HEAVY)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("PROBE "))
    return json.loads(line[len("PROBE "):])


def test_help_imports_no_torch_triton_or_numpy():
    loaded = _probe([[*path, "--help"] for path in COMMAND_PATHS])
    assert len(loaded) == len(COMMAND_PATHS)
    assert {name: mods for name, mods in loaded.items() if mods} == {}


def test_the_probe_sees_a_heavy_import():
    """The probe is not blind: a command that runs (not --help) imports torch and numpy."""
    run = ["bench-radix", "--trace", "tests/data/conversation_head300.jsonl", "-n", "3", "--repeat", "1", "--json"]
    loaded = _probe([["--help"], run])
    assert loaded["--help"] == [] and {"torch", "numpy"} <= set(loaded[" ".join(run)])


def _help(args: list[str]) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], prog_name="memcli", env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.mark.parametrize("args", COMMAND_PATHS, ids=lambda p: " ".join(p) or "memcli")
def test_help_names_values_plainly(args):
    text = _help(args)
    assert "<" not in text and ">" not in text, text  # no <bool>, <int>, <path>
    assert "{" not in text and "}" not in text, text  # no {TRACE} in the usage line


def _summaries(text: str) -> dict[str, str]:
    """The Commands panel: {command: its one-line summary}."""
    panel = text.split("Commands")[1]
    rows = [line.strip("│ ").rstrip() for line in panel.splitlines() if line.startswith("│")]
    out: dict[str, str] = {}
    for row in rows:
        name, _, summary = row.partition("  ")
        if name.strip():
            out[name.strip()] = summary.strip()
        else:  # a wrapped row (narrow terminal): the summary continues
            out[list(out)[-1]] += " " + summary.strip()
    return out


@pytest.mark.parametrize("group", [[], ["reference"]], ids=["memcli", "reference"])
def test_command_summaries_are_whole_sentences(group):
    summaries = _summaries(_help(group))
    assert len(summaries) >= 2
    for name, summary in summaries.items():
        assert summary[0].isupper() and summary.endswith("."), (name, summary)
        assert summary.count(". ") == 0, (name, summary)  # one sentence


def test_a_broken_summary_is_caught():
    text = "Commands\n│ replay   Replay a trace; report hits,  │\n│          allocation │\n"
    assert not _summaries(text)["replay"].endswith(".")


def test_metavars_need_no_typer_internals():
    """Older typer builds options on click: the type name then comes from the click type."""
    from types import SimpleNamespace

    from memcli.cli.options import _type_name

    assert _type_name(SimpleNamespace(type=SimpleNamespace(name="integer"))) == "int"
    assert _type_name(SimpleNamespace(type=SimpleNamespace(name="path"))) == "Path"
    assert _type_name(SimpleNamespace(bare_type=lambda: "float")) == "float"


def test_square_brackets_in_help_are_not_eaten_as_markup():
    """rich reads `[ray]` as a style tag: the help escapes it, so the install hint is whole."""
    text = " ".join(_help(["replay"]).split())
    assert "pip install 'memcli[ray]'" in text


def _commands():
    import typer

    def walk(command, path):
        yield path, command
        for name, sub in sorted((getattr(command, "commands", None) or {}).items()):
            yield from walk(sub, [*path, name])

    return list(walk(typer.main.get_command(app), []))


def test_every_help_text_shows_literally():
    """Every command's and option's help, as `--help` renders it (rich markup read), is the text
    written (an escaped `\\[` shows as `[`): no `[word]` taken for a style tag and dropped."""
    import re

    flat = lambda text: re.sub(r"[\s│╭╮╰╯─]+", " ", text).strip()  # noqa: E731  (the panels' borders too)
    commands = _commands()
    assert {" ".join(path) for path, _ in commands} >= {"replay", "reference diff", "bench-one-batch"}
    for path, command in commands:
        shown = flat(CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "3000", "NO_COLOR": "1"}).stdout)
        assert "\\" not in shown, path
        texts = [p.help for p in command.params if getattr(p, "help", None)]
        texts += [part for part in (command.help or "").split("\n\n") if part.strip()]
        for text in texts:
            assert flat(text.replace("\\[", "[")) in shown, (path, text)


def test_strict_limits_is_documented_on_replay():
    text = " ".join(_help(["replay"]).split())
    assert "--strict-limits" in text and "Refuse a trace with a request past the engine's limits" in text
