"""What every bench script does the same way: its saved figures."""

from __future__ import annotations

from pathlib import Path


def save_figure(fig, path: Path, dpi: int) -> None:
    """Write `fig` to `path` (making its folder) and free it: bench scripts draw many in one run."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
