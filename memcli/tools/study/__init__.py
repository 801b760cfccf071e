"""Studies (`memcli replay TRACE --sweep ...`): one replay per point of a grid, run serially, in
local processes or on Ray, recorded as points finish.

`run.py` (the entry, `run_study`), `results.py` (a point's row, the study's outcome),
`report.py` (the table); `plan.py` (tasks and the plan), `grid.py` (the points),
`executors.py`, `files.py` (study.json / study.csv), `unlimited.py` (the unlimited-pool
reference), `plot.py`. A study imports `memcli.tools.replay`; the replay knows no study.
"""
