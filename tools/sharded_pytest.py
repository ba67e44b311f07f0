"""Run pytest over some test files as N parallel processes on one machine (the GPU runs of
`scripts/h200.sh tests-all`): most of a GPU test's time is compiling kernels on the CPU, and the
device machine has many cores, so N processes finish about N times sooner than one.

    python tools/sharded_pytest.py --shards 8 --logs OUT_DIR [--timeout S] [--ids FILE] -- [FILES_OR_IDS...] [PYTEST ARGS]

The test ids are collected once and dealt round-robin (a file's slow tests spread over the
shards); shard i writes OUT_DIR/shard_i.txt. Prints each shard's summary line and exits 1 if any
shard failed or ran past the timeout.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path


def collect(args: list[str]) -> list[str]:
    listing = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                             capture_output=True, text=True, check=False)
    ids = [line for line in listing.stdout.splitlines() if "::" in line]
    if not ids:
        raise SystemExit(f"sharded_pytest: no tests collected from {args}:\n{listing.stdout[-2000:]}{listing.stderr[-2000:]}")
    return ids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--logs", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds for the whole run")
    parser.add_argument("--ids", type=Path, help="a file of test ids, one a line, to run instead of collecting")
    parser.add_argument("pytest_args", nargs="*", help="test files (or ids) and options, after --")
    opts = parser.parse_args()
    files = [a for a in opts.pytest_args if a and Path(a.split("::")[0]).exists()]  # files or test ids
    flags = [a for a in opts.pytest_args if a not in files]  # options and their values
    ids = opts.ids.read_text().splitlines() if opts.ids else collect(opts.pytest_args)
    shards = [ids[i::opts.shards] for i in range(opts.shards) if ids[i::opts.shards]]
    source = f"the list {opts.ids}" if opts.ids else f"{len(files)} files"
    print(f"{len(ids)} tests from {source} in {len(shards)} shards", flush=True)
    opts.logs.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    procs = []
    for i, shard in enumerate(shards):
        log = open(opts.logs / f"shard_{i}.txt", "w")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "--tb=short",
               "--durations=5", *flags, *shard]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
    failed = False
    for i, (proc, log) in enumerate(procs):
        left = max(1.0, opts.timeout - (time.monotonic() - start))
        try:
            code = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "timeout"
        log.close()
        lines = (opts.logs / f"shard_{i}.txt").read_text().splitlines()
        summary = next((line for line in reversed(lines) if " in " in line and ("passed" in line or "failed" in line
                                                                                 or "error" in line)), "(no summary)")
        print(f"shard {i}: exit {code}: {summary}", flush=True)
        failed |= code != 0
    print(f"wall {time.monotonic() - start:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
