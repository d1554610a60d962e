"""`write_report` and the ``scalescope report`` command (``add_parser``, ``main_report``).

Exit status of the command: 0 written and no rule tripped, 1 a ``--fail-on`` rule
tripped, 2 bad input (missing run, not a run, malformed rule, format the run does not
audit or recipe it does not record, unwritable output), with a one-line message on
stderr.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import analysis as A
from ..store.layout import write_files_atomic
from .collect import ReportError
from .gate import FAIL_ON_HELP, Rule, _as_rules, damage_notes, parse_fail_on
from .page import DEFAULT_MAX_OPS, DEFAULT_MAX_STEPS, DEFAULT_WORST, _build


def _open(path: str | Path) -> Any:
    from ..store import open_run

    return open_run(path)


def write_report(
    run: str | Path | Any,
    html_path: str | Path | None,
    json_path: str | Path | None = None,
    fail_on: str | Sequence[str] | Sequence[Rule] | None = None,
    compare: str | Path | Any = None,
    *,
    thresholds: A.Thresholds | None = None,
    audit: Sequence[str] = (),
    max_ops: int = DEFAULT_MAX_OPS,
    max_steps: int = DEFAULT_MAX_STEPS,
    quiet: bool = False,
    allow_damaged: bool = False,
) -> int:
    """Write the report of ``run`` (a path or reader) to ``html_path`` and/or
    ``json_path`` (parent folders created), print where, and return the exit status:
    0, or 1 when a ``fail_on`` rule trips (each rule's line is printed, the tripped ones
    naming value, op and step; a damaged run trips the gate unless ``allow_damaged``:
    `damage_result`). ``audit``: formats every op is also judged against (as if
    cast: `scalescope.analysis.advise`). Bad input raises: ValueError (malformed rule),
    `ReportError`, `scalescope.RunError` / FileNotFoundError (no run there), OSError
    (cannot write); `main_report` turns those into exit status 2."""
    rules = _as_rules(fail_on)  # a malformed rule fails before any reading
    reader = run if hasattr(run, "stats") else _open(run)
    other = None
    if compare is not None:
        other = compare if hasattr(compare, "stats") else _open(compare)
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    say(f"scalescope report: {reader.path}: {len(reader.ops)} ops, {len(reader.steps)} steps")
    page, verdicts, lines = _build(
        reader,
        compare=other,
        thresholds=thresholds,
        rules=rules,
        max_ops=max_ops,
        max_steps=max_steps,
        worst=DEFAULT_WORST,
        html=html_path is not None,
        audit=tuple(audit),
        allow_damaged=allow_damaged,
    )
    say(verdicts["verdict"]["headline"])
    for note in damage_notes(reader):
        print(f"scalescope report: warning: the run is damaged: {note}", file=sys.stderr)
    # both texts first, then both files to temporary names, renamed once both are
    # written: a failure leaves no half-written report and no report without its JSON
    outputs = []
    if html_path is not None:
        outputs.append((Path(html_path), page.encode("utf-8")))
    if json_path is not None:
        text = json.dumps(verdicts, indent=1, allow_nan=False) + "\n"
        outputs.append((Path(json_path), text.encode("utf-8")))
    for path, _ in outputs:
        _check_folder(path)
    write_files_atomic(outputs)
    for path, data in outputs:
        size = f" ({len(data) / 1e6:.1f} MB)" if path.suffix.lower() in (".html", ".htm") else ""
        say(f"wrote {path}{size}")
    f = verdicts["summary"]["findings"]
    by_sev = ", ".join(f"{v} {k}" for k, v in f["by_severity"].items() if v)
    say(f"{f['total']} finding(s){f' ({by_sev})' if by_sev else ''}")
    for line in lines:
        print(line, flush=True)
    tripped = [r["rule"] for r in verdicts["fail_on"] if r["tripped"]]
    if tripped:
        print(f"scalescope report: --fail-on tripped: {', '.join(tripped)}", file=sys.stderr)
        if "intact run" in tripped:
            print(
                "scalescope report: the run is damaged, so the gate fails closed; "
                "--allow-damaged judges what could be read",
                file=sys.stderr,
            )
        return 1
    return 0


def _check_folder(path: Path) -> None:
    """A clear error when ``path`` cannot be a file: its folder, or a folder above it, is
    a file (``mkdir`` would say only "File exists"), or ``path`` is a folder."""
    if path.is_dir():
        raise ReportError(f"cannot write {path}: it is a folder")
    for above in path.parents:
        if above.exists():
            if not above.is_dir():
                raise ReportError(f"cannot write {path}: {above} is a file, not a folder")
            return


def add_parser(subparsers: Any) -> Any:
    """Add the ``report`` command to an argparse subparsers object."""
    p = subparsers.add_parser(
        "report",
        help="write a standalone HTML precision audit and JSON verdicts; a CI gate",
        description="Write the precision audit of RUN: one standalone HTML file that opens "
        "offline (verdicts per pass and format, advisor findings with source lines, heatmaps, "
        "worst ops with histograms, loss curve, run metadata) and/or JSON verdicts per op. "
        "Exit status: 0 ok, 1 a --fail-on rule tripped, 2 bad input.",
    )
    p.add_argument("run", help="a run directory")
    p.add_argument("-o", "--output", metavar="HTML", help="the HTML report to write")
    p.add_argument("--json", metavar="JSON", help="the JSON verdicts to write")
    p.add_argument("--fail-on", metavar="RULES", action="append", help=FAIL_ON_HELP)
    p.add_argument(
        "--allow-damaged",
        action="store_true",
        help="let --fail-on judge a damaged run (data lost in writing, unreadable parts) "
        "on what could be read; by default a damaged run fails the gate",
    )
    p.add_argument("--compare", metavar="OTHER_RUN", help="another run to compare with")
    p.add_argument(
        "--audit",
        metavar="FORMATS",
        default=None,
        help="comma-separated formats (or recorded recipes) every op is also judged against, "
        "as if the run cast it (default: only the formats each op is cast to)",
    )
    p.add_argument(
        "--max-ops",
        type=int,
        default=DEFAULT_MAX_OPS,
        help=f"heatmap rows before neighbouring ops are merged (default {DEFAULT_MAX_OPS})",
    )
    p.add_argument(
        "--max-steps",
        type=int,
        default=DEFAULT_MAX_STEPS,
        help=f"heatmap columns before steps are merged (default {DEFAULT_MAX_STEPS})",
    )
    return p


def main_report(args: Any) -> int:
    """Run the ``report`` command from parsed arguments; returns the exit status."""

    def fail(message: str) -> int:
        print(f"scalescope report: error: {message}", file=sys.stderr)
        return 2

    if args.output is None and args.json is None and not args.fail_on:
        return fail("nothing to do: give -o HTML, --json JSON and/or --fail-on RULES")
    if args.max_ops < 1 or args.max_steps < 1:
        return fail("--max-ops and --max-steps must be >= 1")
    try:
        rules = parse_fail_on(args.fail_on) if args.fail_on else []
    except ValueError as err:
        return fail(str(err))
    audit = tuple(f.strip() for f in (args.audit or "").split(",") if f.strip())
    if args.audit is not None and not audit:
        return fail("--audit: no format given (e.g. --audit e4m3,e5m2)")
    from ..store import RunError

    try:
        return write_report(
            args.run,
            args.output,
            args.json,
            fail_on=rules,
            compare=args.compare,
            max_ops=args.max_ops,
            max_steps=args.max_steps,
            audit=audit,
            allow_damaged=args.allow_damaged,
        )
    except (ReportError, RunError, FileNotFoundError) as err:
        return fail(str(err))
    except OSError as err:
        return fail(f"cannot write the report: {err}")
