"""What every bench script does the same way: its command line and its saved figures."""

from __future__ import annotations

import argparse
from pathlib import Path


def command_line(doc: str | None) -> argparse.ArgumentParser:
    """A parser whose --help prints the script's docstring as written (its tables and lists)."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def save_figure(fig, path: Path, dpi: int) -> None:
    """Write `fig` to `path` (making its folder) and free it: bench scripts draw many in one run."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
