"""A study's document (one JSON) and table (one CSV), written under `--out DIR` as points finish.

`DIR/study.json` is the document `study_document` builds (the same one `--json` prints), and
`DIR/study.csv` has one row per finished point: its index, the value of every swept key in
its config, then the numbers of `study.point_row`. Both are rewritten whole (to a temporary
file, then renamed) after every finished task, so either is complete at any moment.
`--resume` reads `study.json` back: a point whose overrides are already there is not run
again, provided the study is the same (trace, arrivals, checks, base config).
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any, Optional

from memcli.config import Config
from memcli.errors import MemcliError
from memcli.report.envelope import envelope
from memcli.tools.study.grid import point_key
from memcli.tools.replay.metrics import DEFINITIONS, EVICTION_DEFINITIONS
from memcli.tools.study.plan import StudyContext, StudyState, Task

JSON_NAME, CSV_NAME = "study.json", "study.csv"
# The hit-rate columns of a point's row, and the definition each one follows.
RATE_COLUMNS = {"hit_rate": "hit_rate", "per_request_mean_hit_rate": "per_request_mean",
                "page_hit_rate": "page_hit_rate", "block_ratio": "block_ratio",
                "sglang_batch_mean_hit_rate": "sglang_batch", "sglang_cumulative_hit_rate": "sglang_cumulative",
                "vllm_hit_rate": "vllm", "warmup_excluded_hit_rate": "warmup_excluded",
                "last_1000_hit_rate": "last_1000", "ceiling_hit_rate": "ceiling"}


def config_value(config: Config, key: str) -> Any:
    section, name = key.split(".", 1)
    return config.to_dict()[section][name]


def study_identity(context: StudyContext, base: Config) -> dict[str, Any]:
    """What must match for `--resume` to reuse a row."""
    trace, options = context.trace, context.options
    return {"trace": str(Path(trace.path).resolve()), "requests": trace.num_requests,
            "input_tokens": trace.input_tokens, "arrivals": options.arrivals,
            "check": options.check_level if options.check_every_step else "none", "config": base.to_dict()}


def study_document(state: StudyState, context: StudyContext, executor: str) -> dict[str, Any]:
    """The JSON document of a study: finished points in plan order, then the references."""
    plan = state.plan
    points, references = [], []
    for task in plan.tasks:
        row = state.rows.get(task.key)
        if row is None:
            continue
        if task.kind == "point":
            points.append({"index": task.index, "point": task.point,
                           "config": {key: config_value(task.config, key) for key in plan.keys}, **row})
        else:
            references.append(row)
    num_points = sum(task.kind == "point" for task in plan.tasks)
    return envelope("replay", {
        "study": {"keys": list(plan.keys), "points": num_points, "finished": len(points),
                  "complete": state.complete, "executor": executor},
        "identity": study_identity(context, plan.base),
        "requests": context.trace.num_requests,
        "input_tokens": context.trace.input_tokens,
        "arrivals": context.options.arrivals,
        "definitions": {**{column: DEFINITIONS[name] for column, name in RATE_COLUMNS.items()},
                        "needed_again_share": EVICTION_DEFINITIONS["needed_again"],
                        "reuse_distance_requests_p50": EVICTION_DEFINITIONS["reuse_distance"],
                        "eviction_policy belady": DEFINITIONS["belady"]},
        "points": points,
        "references": references,
    }, plan.base)


class StudyFiles:
    """`DIR/study.json` and `DIR/study.csv`. `check_start(resume)` refuses to overwrite a
    study unless resuming, and `load` returns the rows a resumed study can keep."""

    def __init__(self, out: Path):
        self.out = out
        self.json_path, self.csv_path = out / JSON_NAME, out / CSV_NAME

    def check_start(self, resume: bool) -> None:
        if self.out.exists() and not self.out.is_dir():
            raise MemcliError(f"--out {self.out}: not a folder", "give a folder for study.json and study.csv")
        if not self.out.parent.exists():
            raise MemcliError(f"--out {self.out}: folder {self.out.parent} does not exist",
                              "create it, or choose another --out")
        if self.json_path.exists() and not resume:
            raise MemcliError(f"{self.json_path} already holds a study",
                              f"add --resume to finish it, or choose another --out (or remove {self.json_path})")

    def load(self, identity: dict[str, Any], plan_tasks: tuple[Task, ...]) -> dict[str, dict[str, Any]]:
        """Rows of `self.json_path` that belong to this study, by task key ({} when absent)."""
        if not self.json_path.exists():
            return {}
        try:
            doc = json.loads(self.json_path.read_text(encoding="utf-8"))
            old_identity = doc["identity"]
            entries = [("point", entry["point"], entry) for entry in doc["points"]]
            entries += [("reference", {"memory.page_size": ref["page_size"]}, ref) for ref in doc["references"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise MemcliError(f"--resume: {self.json_path} is not a study document ({type(exc).__name__}: {exc})",
                              "choose another --out, or remove the file to start again") from None
        if old_identity != identity:
            differs = sorted(k for k in set(identity) | set(old_identity) if identity.get(k) != old_identity.get(k))
            raise MemcliError(f"--resume: {self.json_path} is a study of something else (differs in: {', '.join(differs)})",
                              "resume with the same trace, options and config, or choose another --out")
        wanted = {task.key for task in plan_tasks}
        rows = {}
        for kind, point, entry in entries:
            key = f"{kind}:{point_key(point)}"
            if key in wanted:
                rows[key] = {k: v for k, v in entry.items() if k not in ("index", "point", "config")}
        return rows

    def write(self, document: dict[str, Any]) -> None:
        self.out.mkdir(exist_ok=True)
        _atomic_write(self.json_path, json.dumps(document, indent=2) + "\n")
        _atomic_write(self.csv_path, csv_text(document))


def csv_text(document: dict[str, Any]) -> str:
    keys = document["study"]["keys"]
    rows = []
    for entry in document["points"]:
        numbers = {k: v for k, v in entry.items() if k not in ("index", "point", "config")}
        rows.append({"index": entry["index"], **{key: entry["config"][key] for key in keys}, **numbers})
    import io

    buffer = io.StringIO()
    columns = ["index", *keys]
    for row in rows:  # points of other cache kinds may carry more columns (hiradix: the host tier)
        columns += [c for c in row if c not in columns]
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n", restval="")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def read_rows(path: Path) -> Optional[list[dict[str, Any]]]:
    """The points of a study document (for tests and tools); None when absent."""
    if not path.exists():
        return None
    return json.loads(path.read_text(encoding="utf-8"))["points"]
