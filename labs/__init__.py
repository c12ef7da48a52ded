"""GPU-engineering labs on the tileattn runtime (see LABS.md); each runs as `python -m labs.<name>`."""

from __future__ import annotations

import sys


def run_lab(main, name: str, argv=None) -> int:
    """A lab's `python -m labs.<name>` entry: main(argv)'s status, or, on a machine without an NVIDIA
    GPU, one line on stderr and status 1 (as the `tileattn` commands do) instead of a traceback."""
    from tileattn.runtime import NoGPUError

    try:
        return main(argv)
    except NoGPUError as exc:
        print(f"python -m labs.{name}: {exc}", file=sys.stderr)
        return 1
