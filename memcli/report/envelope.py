"""The one envelope of every `--json` document (docs/JSON.md).

    {"command": "replay", "memcli_version": "0.1.0", "profile": "sglang-0.5.5",
     "config": {...}, ...the command's own fields}

`profile` and `config` are the resolved config's semantics label and its full tree, or null
for a command that reads no config (`gen-trace`, `reference fetch`). A command's own fields
follow, in its own order; none may reuse an envelope key.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Protocol

from memcli import __version__

ENVELOPE_KEYS = ("command", "memcli_version", "profile", "config")


class _Config(Protocol):
    semantics: Any

    def to_dict(self) -> dict[str, Any]: ...


def envelope(command: str, fields: Mapping[str, Any], config: Optional[_Config] = None) -> dict[str, Any]:
    """The document of `command`: the envelope keys, then `fields`.

    Raises `ValueError` when `fields` holds an envelope key (a bug in the command)."""
    clash = sorted(set(ENVELOPE_KEYS) & set(fields))
    if clash:
        raise ValueError(f"{command}: its fields {clash} would overwrite the JSON envelope")
    return {
        "command": command,
        "memcli_version": __version__,
        "profile": config.semantics.label if config is not None else None,
        "config": config.to_dict() if config is not None else None,
        **fields,
    }
