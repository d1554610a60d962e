"""The precision-audit report: one standalone HTML file, JSON verdicts and a CI gate.

``scalescope report RUN -o audit.html [--json audit.json] [--fail-on RULES]
[--compare OTHER_RUN]`` (or `write_report` from Python) reads a recorded run and writes
the HTML page (its sections: `scalescope.report.page`), the JSON verdicts (their schema:
`scalescope.report.verdicts`) and, with ``--fail-on`` (the rules:
`scalescope.report.gate`), exits 1 when a rule trips.

One idea per module:

* `collect`: what every section reads, computed once from one read of the statistics;
  `ReportError` (bad input);
* `gate`: the ``--fail-on`` rules: `parse_fail_on`, `evaluate_rules`;
* `verdicts`: the JSON document;
* `markup`: HTML pieces (style sheet, tables, cells, numbers, source lines);
* `sections`: the text sections (title, gate results, verdicts, findings, metadata);
* `heatmaps`: the op x step heatmaps and how thousands of ops fit;
* `worst`: the worst ops, each with its histogram and block scales;
* `compare`: ``--compare``, a run against another;
* `figures`: the loss curve and the scale graph;
* `page`: `build_report`, the page assembled;
* `command`: `write_report` and the ``scalescope report`` command.

Exit status of the command: 0 written and no rule tripped, 1 a ``--fail-on`` rule
tripped, 2 bad input (missing run, not a run, malformed rule, format the run does not
audit or recipe it does not record, unwritable output), with a one-line message on
stderr.
"""

from .collect import ReportError
from .command import add_parser, main_report, write_report
from .compare import COMPARE_ROWS
from .figures import MAX_SCALAR_POINTS
from .gate import FAIL_ON_HELP, Rule, evaluate_rules, parse_fail_on
from .page import DEFAULT_MAX_OPS, DEFAULT_MAX_STEPS, DEFAULT_WORST, build_report
from .sections import MAX_FINDING_ROWS
from .verdicts import REPORT_SCHEMA, REPORT_VERSION

__all__ = [
    "COMPARE_ROWS",
    "DEFAULT_MAX_OPS",
    "DEFAULT_MAX_STEPS",
    "DEFAULT_WORST",
    "FAIL_ON_HELP",
    "MAX_FINDING_ROWS",
    "MAX_SCALAR_POINTS",
    "REPORT_SCHEMA",
    "REPORT_VERSION",
    "ReportError",
    "Rule",
    "add_parser",
    "build_report",
    "evaluate_rules",
    "main_report",
    "parse_fail_on",
    "write_report",
]
