"""What `show-config` shows: the resolved config, every semantics behaviour in force, and the
sizes derived from the config."""

from __future__ import annotations

from dataclasses import dataclass, field

from memcli.config import Config


@dataclass(frozen=True)
class ShowConfigResult:
    config: Config
    semantics_in_force: dict[str, str]
    derived: dict[str, int]
    label: str = ""  # the title of the semantics in force: the engine's own, when it describes itself
    engine: str = ""  # the engine's name and summary line
    baseline: str = ""  # the engine's earlier release (`Engine.baseline`), or ""
    # {key: the baseline's value} for each behaviour in force whose value differs from the baseline's
    baseline_differs: dict[str, str] = field(default_factory=dict)
