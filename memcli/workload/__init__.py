"""Workloads: trace readers (`readers`) and the generator (`generate`). Pure data in, request
specs out.

Nothing is imported here: the CLI reads the defaults below for its --help, which must not
import numpy.
"""

FORMATS = ("auto", "memcli", "mooncake")
DEFAULT_MAX_TOKENS = 50_000_000  # gen-trace --max-tokens: about 300 MB of JSON and a few GB while generating
