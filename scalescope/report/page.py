"""The report, assembled (`build_report`): the JSON verdicts and the standalone HTML page.

The page: one file that opens offline with no network request (plain Bokeh, BokehJS
inline; no Panel, no CDN, no web font). Sections, each a Bokeh model with a stable
``name`` (``Bokeh.documents[0].get_model_by_name(name)``): ``report-title``,
``report-fail-on`` (with ``--fail-on``), ``report-summary`` (safe ops per pass and
format or recipe; with recipes, the cheapest safe recipe's op count per pass),
``report-findings`` (the advisor's findings with their source lines),
``report-heatmaps`` then ``report-heatmap-<metric>`` figures (op x step, rows and steps
merged in their worse direction when there are more than ``max_ops`` / ``max_steps``),
``report-worst-ops`` then per op ``report-op-<k>``, ``report-histogram-<k>`` (exponent
histogram at the op's worst step) and, with recipes, ``report-scales-<k>`` (each
recipe's block scales over steps against its element format's range), ``report-loss`` (loss
curve; both runs with ``--compare``), ``report-scale-graph`` (the latest scale graph
recorded with `Run.scale_graph`, if any), ``report-compare`` (with ``--compare``) and
``report-metadata``. The file stays a few MB for thousands of ops (measured in the
tests). When the run's statistics are estimates (recorded with ``sample=``) or its ops
were measured in turns under an overhead budget, every section computed from
statistics carries a note saying so (``class="stat-note"``); heatmap cells of an op not
measured at a step are blank (hatched), measured NaN cells grey.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import analysis as A
from .collect import _collect, _RunData
from .compare import _compare_data, _compare_html
from .figures import _loss_models, _scale_graph_models
from .gate import Rule, _as_rules, _check_rules, damage_result, evaluate_rules
from .heatmaps import _heatmaps
from .markup import _CSS, _WIDTH
from .sections import (
    _fail_on_html,
    _findings_html,
    _incidents_html,
    _metadata_html,
    _summary_html,
    _title_html,
    _verified_html,
)
from .verdicts import _verdicts
from .worst import _worst_op_models

#: Heatmap rows (ops) and columns (steps) beyond which neighbours are merged.
DEFAULT_MAX_OPS = 600
DEFAULT_MAX_STEPS = 200
#: Ops shown with a histogram in the "worst ops" section.
DEFAULT_WORST = 6


def _check_limit(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return int(value)


def build_report(
    reader: Any,
    *,
    compare: Any = None,
    thresholds: A.Thresholds | None = None,
    fail_on: str | Sequence[str] | Sequence[Rule] | None = None,
    max_ops: int = DEFAULT_MAX_OPS,
    max_steps: int = DEFAULT_MAX_STEPS,
    worst: int = DEFAULT_WORST,
    audit: Sequence[str] = (),
    allow_damaged: bool = False,
) -> tuple[str, dict[str, Any]]:
    """The report of run ``reader`` (a `scalescope.open_run` reader): ``(html, verdicts)``.

    ``html``: a complete standalone page (its sections: this module's docstring);
    ``verdicts``: the JSON document (plain types; ``json.dumps(verdicts)`` is the JSON
    report). ``compare``: another reader, drawn in the loss curve and compared op by op.
    ``thresholds``: the advisor's (default `Thresholds()`). ``fail_on``: rules (text or
    `Rule`s) evaluated into ``verdicts["fail_on"]`` and shown at the top of the page.
    ``max_ops`` / ``max_steps``: heatmap rows and columns beyond which neighbours are
    merged (keeps the file small for thousands of ops); ``worst``: ops shown with a
    histogram; ``audit``: formats every op is judged against as if cast (the advisor's
    ``audit``). With rules, a damaged run (lost or unreadable data: `damage_result`)
    trips the gate unless ``allow_damaged``. Raises `ReportError` for a run without
    recorded steps or a rule on a format the run does not audit, ValueError for a
    malformed rule.
    """
    page, verdicts, _ = _build(
        reader,
        compare=compare,
        thresholds=thresholds,
        rules=_as_rules(fail_on),
        max_ops=max_ops,
        max_steps=max_steps,
        worst=worst,
        html=True,
        audit=tuple(audit),
        allow_damaged=allow_damaged,
    )
    return page, verdicts


def _build(
    reader: Any,
    *,
    compare: Any,
    thresholds: A.Thresholds | None,
    rules: list[Rule],
    max_ops: int,
    max_steps: int,
    worst: int,
    html: bool,
    audit: tuple[str, ...] = (),
    allow_damaged: bool = False,
) -> tuple[str | None, dict[str, Any], list[str]]:
    """`build_report`, the HTML only when ``html``; also the rules' one-line results."""
    with np.errstate(invalid="ignore", divide="ignore"):  # NaN statistics are expected
        return _build_quiet(
            reader,
            compare,
            thresholds,
            rules,
            max_ops,
            max_steps,
            worst,
            html,
            audit,
            allow_damaged,
        )


def _build_quiet(
    reader, compare, thresholds, rules, max_ops, max_steps, worst, html, audit, allow_damaged
):
    thresholds = A.Thresholds() if thresholds is None else thresholds
    max_ops, max_steps = _check_limit("max_ops", max_ops), _check_limit("max_steps", max_steps)
    worst = _check_limit("worst", worst)
    data = _collect(reader, thresholds, audit)
    _check_rules(rules, data.formats, data.recipes)
    results = evaluate_rules(data, rules)
    damaged = damage_result(reader, allow_damaged) if rules else None
    if damaged is not None:
        results.append(damaged)
    cmp = _compare_data(data, compare) if compare is not None else None
    page = _page(data, compare, cmp, results, max_ops, max_steps, worst) if html else None
    return page, _verdicts(reader, data, thresholds, results, cmp), [r["text"] for r in results]


def _page(
    data: _RunData,
    compare: Any,
    cmp: dict[str, Any] | None,
    results: list[dict[str, Any]],
    max_ops: int,
    max_steps: int,
    worst: int,
) -> str:
    """The standalone HTML: one Bokeh column of named sections."""
    from bokeh.layouts import column
    from bokeh.models import Div, InlineStyleSheet

    from .. import viz

    reader = data.reader
    data.css = InlineStyleSheet(css=_CSS)

    def div(text: str, name: str) -> Div:
        return Div(text=text, name=name, width=_WIDTH, stylesheets=[data.css])

    models: list[Any] = [div(_title_html(reader, data, compare), "report-title")]
    if results:
        models.append(div(_fail_on_html(results), "report-fail-on"))
    models.append(div(_summary_html(data), "report-summary"))
    verified = _verified_html(reader)
    if verified:
        models.append(div(verified, "report-verified"))
    incidents = _incidents_html(data)
    if incidents:
        models.append(div(incidents, "report-incidents"))
    models.append(div(_findings_html(data), "report-findings"))
    models += _heatmaps(data, max_ops, max_steps)
    models += _worst_op_models(data, worst)
    models += _loss_models(data, compare)
    models += _scale_graph_models(data)
    if cmp is not None:
        models.append(div(_compare_html(data, cmp), "report-compare"))
    models.append(div(_metadata_html(reader, data), "report-metadata"))
    return viz.standalone_html(
        column(*models, name="report"), title=f"scalescope audit: {reader.name}"
    )
