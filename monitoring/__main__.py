"""`python -m monitoring DIR`: write every dashboard's JSON into DIR (`make dashboards`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from monitoring.dashboards import DASHBOARDS
from monitoring.grafana import to_json


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m monitoring", description=__doc__)
    parser.add_argument("directory", type=Path)
    directory = parser.parse_args().directory
    directory.mkdir(parents=True, exist_ok=True)
    for dashboard in DASHBOARDS:
        (directory / dashboard.file_name).write_text(to_json(dashboard))
        print(directory / dashboard.file_name)


if __name__ == "__main__":
    main()
