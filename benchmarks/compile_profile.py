"""Where a test run's JAX time goes, from the compile log of `SCALESCOPE_COMPILE_LOG`.

    SCALESCOPE_COMPILE_LOG=/tmp/log make test      # every process of the run logs
    python benchmarks/compile_profile.py /tmp/log  # sums it up

The log holds one line per trace, lowering and XLA compile of every Python process the
run started (tests/compile_log/sitecustomize.py), each with its test. This prints the
totals, then the tests and the programs that cost most. A compile is a persistent-cache
hit when the cache said so just before it: loading a big executable still costs seconds
(docs/benchmarks.md, "The test suite on a fresh machine"), so hits are summed apart. Last,
the programs compiled more than once (the same cache key missed twice).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: A compile of this many seconds or more is a "big program" in the summary.
BIG_S = 1.0


@dataclass
class Totals:
    """Seconds and counts of one group of log rows (a test, a program, the whole run)."""

    compile_s: float = 0.0
    hit_s: float = 0.0
    trace_s: float = 0.0
    lower_s: float = 0.0
    compiles: int = 0
    hits: int = 0
    big: list[float] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return self.compile_s + self.hit_s + self.trace_s + self.lower_s


def read_log(folder: Path) -> list[dict]:
    """Every row of every ``*.jsonl`` file in ``folder``, each with ``hit`` set on the
    compiles the persistent cache served, and ``key`` on the others (the cache key JAX
    logged just before, None when it did not). A torn last line (a killed process) is
    skipped."""
    rows = []
    files = sorted(folder.glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.jsonl compile log (was the run started "
                                "with SCALESCOPE_COMPILE_LOG set to it?)")  # fmt: skip
    for path in files:
        hit: dict[Any, bool] = {}  # per thread: a budgeted run compiles in a thread of its own
        key: dict[Any, str | None] = {}
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                print(f"{path.name}:{n}: unreadable line skipped", file=sys.stderr)
                continue
            thread = row.get("thread")
            if row.get("event") == "cache_hit":
                hit[thread] = True
                continue
            if row.get("event") == "cache_miss":
                key[thread] = row.get("key")
                continue
            if row.get("event") == "backend_compile_duration":
                row["hit"] = hit.pop(thread, False)
                row["key"] = None if row["hit"] else key.get(thread)
            key.pop(thread, None)  # a key names the compile right after it, or none
            rows.append(row)
    return rows


def _key(row: dict, by: str) -> str:
    if by == "all":
        return "all"
    test = row.get("test", "").split(" ")[0] or f"(no test) {row.get('argv', '')[:60]}"
    if by == "module":
        return test.split("::")[0]
    if by == "test":
        return test
    return row.get("fun", "") or "?"


def summarize(rows: list[dict], by: str) -> dict[str, Totals]:
    """``by``: ``"module"``, ``"test"``, ``"program"`` (the jitted function's name) or
    ``"all"`` (one group)."""
    out: dict[str, Totals] = defaultdict(Totals)
    for row in rows:
        t = out[_key(row, by)]
        seconds, event = float(row.get("seconds", 0.0)), row.get("event")
        if event == "backend_compile_duration":
            if row.get("hit"):
                t.hit_s += seconds
                t.hits += 1
            else:
                t.compile_s += seconds
                t.compiles += 1
                if seconds >= BIG_S:
                    t.big.append(seconds)
        elif event == "jaxpr_trace_duration":
            t.trace_s += seconds
        elif event == "jaxpr_to_mlir_module_duration":
            t.lower_s += seconds
    return dict(out)


def compiled_twice(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    """Programs compiled more than once (the same cache key missed again: two processes
    compiling it at once, or the cache off), most seconds first."""
    by_key: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if row.get("event") == "backend_compile_duration" and row.get("key"):
            by_key[row["key"]].append(row)
    twice = [(k, v) for k, v in by_key.items() if len(v) > 1]
    return sorted(twice, key=lambda kv: -sum(float(r["seconds"]) for r in kv[1]))


def _twice_text(rows: list[dict], top: int) -> str:
    keyed = sum(1 for r in rows if r.get("key"))
    if not keyed:
        return "No cache keys in the log: programs compiled twice cannot be told."
    twice = compiled_twice(rows)
    extra = sum(sum(sorted(float(r["seconds"]) for r in v)[1:]) for _, v in twice)
    lines = [
        f"## Compiled more than once\n\n{len(twice)} of the programs with a logged key "
        f"({keyed} compiles) compiled again: {extra:.1f} s beyond each one's fastest compile."
    ]
    for key, seen in twice[:top]:
        tests = "; ".join(sorted({r.get("test", "").split(" ")[0] or "(no test)" for r in seen}))
        total = sum(float(r["seconds"]) for r in seen)
        lines.append(f"{total:8.1f} s  {len(seen)}x  {key[:60]}  {tests[:120]}")
    return "\n".join(lines)


def table(groups: dict[str, Totals], top: int, title: str) -> str:
    lines = [f"## {title}", ""]
    lines.append(
        f"{'total s':>8} {'compile s':>9} {'n':>5} {'big':>4} {'hits s':>7} {'hits':>5} "
        f"{'trace s':>8} {'lower s':>8}  name (largest compiles, s)"
    )
    for name, t in sorted(groups.items(), key=lambda kv: -kv[1].total_s)[:top]:
        largest = ", ".join(f"{s:.1f}" for s in sorted(t.big, reverse=True)[:5])
        lines.append(
            f"{t.total_s:8.1f} {t.compile_s:9.1f} {t.compiles:5d} {len(t.big):4d} "
            f"{t.hit_s:7.1f} {t.hits:5d} {t.trace_s:8.1f} {t.lower_s:8.1f}  {name}"
            + (f" ({largest})" if largest else "")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the SCALESCOPE_COMPILE_LOG folder")
    parser.add_argument("--top", type=int, default=25, help="rows per table (default 25)")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a folder")
    try:
        rows = read_log(args.folder)
    except FileNotFoundError as err:
        print(f"compile_profile: {err}", file=sys.stderr)
        return 2
    whole = summarize(rows, "all").get("all", Totals())
    big = len(whole.big)
    print(
        f"# compile profile of {args.folder}: {len(list(args.folder.glob('*.jsonl')))} "
        f"processes\n\nXLA compiles {whole.compile_s:.0f} s ({whole.compiles} programs, "
        f"{big} of >= {BIG_S:g} s making {sum(whole.big):.0f} s, {whole.compiles - big} "
        f"smaller); persistent-cache hits {whole.hit_s:.0f} s ({whole.hits}); tracing "
        f"{whole.trace_s:.0f} s; lowering {whole.lower_s:.0f} s.\n"
    )
    for by, title in (("module", "By test module"), ("test", "By test"), ("program", "By program")):
        print(table(summarize(rows, by), args.top, title) + "\n")
    print(_twice_text(rows, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
