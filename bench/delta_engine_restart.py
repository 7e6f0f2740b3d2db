"""Each link's restart time with two builds of lastagent, side by side in one run (issue 55: one Delta engine).

Runs `long_run.py` for each link kind (Kafka -> Kafka, Kafka -> Delta, Delta -> Kafka, the epoch block) with the
Python of each build in turn (`--before`, `--after`: virtualenvs with lastagent installed), alternating, so both see
the machine as it is; prints one JSON line per run and then a markdown table of the time from `start()` to the first
epoch's end after BENCH_FIRST_RESTART and after BENCH_EPOCHS epochs (long_run.py's restart figures; lastagent's
links only, not Spark's own).

    cd bench && BENCH_EPOCHS=150 BENCH_FIRST_RESTART=50 BENCH_WINDOW=50 ../.venv/bin/python delta_engine_restart.py \\
        --before /path/to/old-venv/bin/python --after ../.venv/bin/python

A broker must be up (`make kafka-up`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

LINKS = ("kafka-kafka", "kafka-delta", "delta-kafka", "block")


def run(python: str, link: str) -> dict:
    done = subprocess.run([python, "long_run.py"], cwd=Path(__file__).parent, capture_output=True, text=True,
                          env={**os.environ, "BENCH_LINK": link, "BENCH_PEER": "0"}, timeout=3600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"long_run.py ({link}, {python}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout[done.stdout.index("{"):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the Python of the build before")
    parser.add_argument("--after", required=True, help="the Python of the build after")
    args = parser.parse_args()
    rows = []
    for link in LINKS:
        figures = {}
        for name, python in (("before", args.before), ("after", args.after)):
            summary = run(python, link)
            print(json.dumps({"link": link, "build": name, **summary}), flush=True)
            figures[name] = summary["lastagent"]["restart_to_first_epoch_s"]
        rows.append((link, figures))
    print("\n| link | restart after | before (s) | after (s) | after / before |\n|---|---|---:|---:|---:|")
    for link, figures in rows:
        for when in figures["before"]:
            before, after = figures["before"][when], figures["after"][when]
            print(f"| {link} | {when} | {before:.2f} | {after:.2f} | {after / before:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
