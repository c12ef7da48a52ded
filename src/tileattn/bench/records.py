"""Benchmark records as JSON: one file per run = the environment + a list of flat records.

A record is a dict with at least `suite`, `impl` and `timing` (Timing.as_dict()), plus the case's
parameters (e.g. n, dtype, causal) and derived metrics (tflops, gbps, ...), all flat so the
reporter can pivot on any key.
"""

from __future__ import annotations

import json
from pathlib import Path

from .env import environment


def write_run(path: str | Path, records: list[dict], env: dict | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"environment": env or environment(), "records": records}, indent=1))
    return path


def read_run(path: str | Path) -> tuple[dict, list[dict]]:
    data = json.loads(Path(path).read_text())
    if "environment" not in data or "records" not in data:
        raise ValueError(f"{path} is not a tileattn benchmark run (needs 'environment' and 'records')")
    return data["environment"], data["records"]


def save_run(records: list[dict], env: dict, text: str, json_path: str | Path | None = None,
             markdown_path: str | Path | None = None) -> None:
    """A benchmark's outputs: the JSON record (when json_path) and its Markdown tables headed by the
    environment line (when markdown_path)."""
    from .report import environment_line

    if json_path:
        write_run(json_path, records, env)
    if markdown_path:
        Path(markdown_path).write_text(environment_line(env) + "\n\n" + text + "\n")
