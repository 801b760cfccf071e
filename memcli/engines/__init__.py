"""The engine registry: engines by name, and the one way tools reach an engine.

    engines.get(config)            the engine `config.semantics.engine` names
    engines.names()                every registered name
    engines.register(engine)       add one (an engine's module calls it when imported)

The built-in engines are registered on first use. An unknown name is a `ConfigError` (exit 2)
that lists the names.
"""

from __future__ import annotations

from typing import Union

from memcli.config import Config
from memcli.engines.base import Engine, Scheduler
from memcli.errors import ConfigError

__all__ = ["Engine", "Scheduler", "get", "names", "register", "unregister"]

_ENGINES: dict[str, Engine] = {}
_BUILTIN_LOADED = False


def _load_builtin() -> None:
    global _BUILTIN_LOADED
    if not _BUILTIN_LOADED:
        _BUILTIN_LOADED = True
        from memcli.engines import sglang_055  # noqa: F401  (registers itself)
        from memcli.engines import vllm_033  # noqa: F401
        from memcli.engines import sglang_0523  # noqa: F401


def register(engine: Engine) -> Engine:
    """Add `engine`; a second engine of the same name is refused (`ValueError`)."""
    if engine.name in _ENGINES and _ENGINES[engine.name] is not engine:
        raise ValueError(f"an engine named {engine.name!r} is already registered")
    _ENGINES[engine.name] = engine
    return engine


def unregister(name: str) -> None:
    _ENGINES.pop(name, None)


def names() -> list[str]:
    _load_builtin()
    return sorted(_ENGINES)


def get(which: Union[str, Config]) -> Engine:
    """The engine of that name (or that `config.semantics.engine` names)."""
    _load_builtin()
    name = which.semantics.engine if isinstance(which, Config) else which
    engine = _ENGINES.get(name)
    if engine is None:
        raise ConfigError(f"semantics.engine: unknown engine {name!r}",
                          hint=f"use one of: {', '.join(names())} (--engine NAME or --set semantics.engine=NAME)")
    return engine
