"""Draw a training run: `python scripts/plot_run.py runs/d12` writes runs/d12/run.png.

Thin entrypoint: parse flags into PlotConfig (tyro), call nanochat.report.plot.plot_run, print the path.
What is drawn and how to read it: docs/plot.md. Needs matplotlib: pip install -e '.[plots]'.
A bad run directory, a missing matplotlib or an --out that plot_run did not draw is one
`error:` line, exit 2.
"""

import sys

from nanochat.common import run_main, setup_logging
from nanochat.config import PlotConfig, parse_cli


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(PlotConfig, argv)
    return run_main(lambda: plot(cfg), debug=cfg.debug)


def plot(cfg: PlotConfig) -> int:
    from nanochat.report.plot import plot_run

    setup_logging()
    print(plot_run(cfg.run_dir, cfg.out, overwrite=cfg.overwrite, max_rows=cfg.max_rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
