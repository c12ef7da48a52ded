"""GPU-engineering labs on the tileattn runtime (see LABS.md); each runs as `python -m labs.<name>`."""

from __future__ import annotations


def run_lab(main, name: str, argv=None) -> int:
    """A lab's `python -m labs.<name>` entry: main(argv)'s status, or, on a machine without an NVIDIA
    GPU, one line on stderr and status 1 (tileattn.cli.report_missing_gpu, as the `tileattn` commands
    report it) instead of a traceback."""
    from tileattn.cli import report_missing_gpu

    return report_missing_gpu(lambda: main(argv), f"python -m labs.{name}")
