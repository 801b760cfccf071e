"""SGLang 0.5.5's own memory-stack code, loaded at run time, to test memcli against it.

Nothing of SGLang is stored in this repository: `fetch` downloads the wheel from PyPI into
a cache directory, `loader` imports its real modules (with documented stand-ins for the
heavy ones), and `ops` drives SGLang's RadixCache and allocator side by side with memcli's.
"""

from memcli.mem_cache.clock import LogicalClock
from memcli.reference.fetch import (
    SGLANG_VERSION,
    ReferenceFetchError,
    default_cache_dir,
    extract,
    fetch_reference,
    fetch_wheel,
    reference_available,
    unavailable_reason,
)
from memcli.reference.loader import Reference, ReferenceImportError, load_reference
from memcli.reference.standins import STANDINS, StandInUsed

__all__ = [
    "SGLANG_VERSION", "STANDINS", "LogicalClock", "Reference", "ReferenceFetchError", "ReferenceImportError",
    "StandInUsed", "default_cache_dir", "extract", "fetch_reference", "fetch_wheel", "load_reference",
    "reference_available", "unavailable_reason",
]
