"""Where the suite's CPU goes, per module and per test, from a run with ``MIRRORAX_TEST_CPU_LOG=DIR``.

    MIRRORAX_TEST_CPU_LOG=/tmp/prof python -m pytest -q   # tests/conftest.py writes DIR/tests.jsonl,
    python tests/tools/cpu_report.py /tmp/prof 20          #   the fork servers DIR/jobs.jsonl

A test's CPU is its process's own (``self``), the children it started and reaped (``kids``: a fresh
interpreter) and the jobs the zygote forked for it (``jobs``: they are the zygote server's children, not
the test's). A ``jobs/forks.py`` server's children count where the server is reaped: the docs pages all in
the last test of ``test_docs.py`` (its module fixture closes the server), the keras.io battery's workers
nowhere (its server ends with the session). Those workers and the servers' own imports are the run's
``user+sys`` less the total here.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path


def report(directory: Path, top: int = 0) -> str:
    tests = [json.loads(line) for line in (directory / "tests.jsonl").read_text().splitlines() if line]
    jobs: collections.Counter[str] = collections.Counter()
    if (directory / "jobs.jsonl").exists():
        for line in (directory / "jobs.jsonl").read_text().splitlines():
            job = json.loads(line)
            jobs[job["test"].rsplit(" (", 1)[0]] += job["cpu"]  # "path::name (call)": the test's id
    rows = [dict(t, jobs=jobs.get(t["id"], 0.0), cpu=t["self"] + t["kids"] + jobs.get(t["id"], 0.0)) for t in tests]
    modules: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0, 0.0])
    for r in rows:
        m = modules[r["id"].split("::")[0]]
        for i, value in enumerate((1, r["cpu"], r["wall"], r["self"], r["kids"], r["jobs"])):
            m[i] += value
    lines = ["| module | tests | CPU s | wall s | self | kids | jobs |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, m in sorted(modules.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| `{name}` | {m[0]:.0f} | {m[1]:.0f} | {m[2]:.0f} | {m[3]:.0f} | {m[4]:.0f} | {m[5]:.0f} |")
    total = [sum(m[i] for m in modules.values()) for i in range(6)]
    lines.append(f"| all | {total[0]:.0f} | {total[1]:.0f} | {total[2]:.0f} | {total[3]:.0f} | {total[4]:.0f} | "
                 f"{total[5]:.0f} |")
    if top:
        lines += ["", f"The {top} tests that used the most CPU (s of CPU, s of wall):"]
        for r in sorted(rows, key=lambda r: -r["cpu"])[:top]:
            lines.append(f"{r['cpu']:7.1f} {r['wall']:7.1f}  {r['id']}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0))
