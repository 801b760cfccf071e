"""`memcli show-config`: the resolved config and the pool sizes derived from it."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

from memcli.cli.options import EngineOpt, with_engine, ConfigOpt, JsonOpt, SetOpt


def show_config(
    config: Optional[Path] = ConfigOpt,
    set_: List[str] = SetOpt,
    engine: Optional[str] = EngineOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Print the resolved config and the sizes derived from it."""
    from memcli.config import load_config
    from memcli.report.console import print_json, stdout_console
    from memcli.tools.show_config.report import render, show_config_document
    from memcli.tools.show_config.run import run_show_config

    result = run_show_config(load_config(config, with_engine(set_, engine)))
    if json_out:
        print_json(show_config_document(result))
        return
    render(result, stdout_console())
