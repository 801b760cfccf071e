"""What `show-config` shows: the resolved config, every semantics behaviour in force, and the
sizes derived from the config."""

from __future__ import annotations

from dataclasses import dataclass

from memcli.config import Config


@dataclass(frozen=True)
class ShowConfigResult:
    config: Config
    semantics_in_force: dict[str, str]
    derived: dict[str, int]
    label: str = ""  # the title of the semantics in force: the engine's own, when it describes itself
