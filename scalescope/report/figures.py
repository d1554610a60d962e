"""The run-wide figures of the report: the loss curve (both runs with ``--compare``) and
the latest recorded scale graph."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from .collect import _RunData
from .compare import _run_names
from .markup import _WIDTH

#: Points of a loss curve (more are thinned, keeping every non-finite one).
MAX_SCALAR_POINTS = 4000


def _thin_scalars(frame: pd.DataFrame) -> pd.DataFrame:
    """At most about `MAX_SCALAR_POINTS` rows, keeping every row with a non-finite value."""
    if len(frame) <= MAX_SCALAR_POINTS:
        return frame
    stride = math.ceil(len(frame) / MAX_SCALAR_POINTS)
    keep = np.zeros(len(frame), bool)
    keep[::stride] = True
    keep[-1] = True
    values = frame.to_numpy(np.float64, na_value=np.nan)
    keep |= np.isinf(values).any(axis=1)
    # the first NaN of a column that never recovers (a diverged loss) must survive
    nan = np.isnan(values)
    for j in range(values.shape[1]):
        if nan[:, j].any():
            keep[int(np.argmax(nan[:, j]))] = True
    return frame[keep]


def _loss_models(data: _RunData, compare: Any) -> list[Any]:
    from bokeh.models import Div

    from .. import viz

    runs = {data.reader.name: data.reader.scalars}
    if compare is not None:
        a, b = _run_names(data.reader, compare)
        runs = {a: data.reader.scalars, b: compare.scalars}
    runs = {k: _thin_scalars(v) for k, v in runs.items()}
    has_loss = any({"loss", "val_loss"} & set(v.columns) for v in runs.values())
    text = "<h2>Loss</h2>"
    if not has_loss:
        text += '<div class="note">No loss was logged (run.log(step, loss=...)).</div>'
    elif not getattr(data.reader, "loss_logged", True) and "loss" in data.reader.scalars:
        text += (
            '<div class="note">No loss was logged: this is the tracked step\'s own loss '
            "output, as the flight recorder read it at every step.</div>"
        )
    models: list[Any] = [
        Div(text=text, name="report-loss-section", width=_WIDTH, stylesheets=[data.css])
    ]
    figure = viz.loss_curve(runs, name="report-loss")
    models.append(figure)
    return models


def _scale_graph_models(data: _RunData) -> list[Any]:
    """The latest scale graph recorded in the run (`Run.scale_graph`), if any."""
    from bokeh.models import Div

    from .. import viz

    steps = data.reader.scale_graph_steps
    if not steps:
        return []
    step = steps[-1]
    frame = data.reader.scale_graph(step)
    text = (
        f"<h2>Scale graph</h2><p>Each op's value (circle) and gradient (triangle) as log2 RMS "
        f"at step {step} (recorded at steps {', '.join(map(str, steps))}), with each format's "
        "normal range shaded and its subnormal floor dashed.</p>"
    )
    fig = viz.scale_graph_figure(frame, data.formats, title=f"scale graph, step {step}")
    fig.name, fig.sizing_mode, fig.width = "report-scale-graph", "fixed", _WIDTH
    head = Div(text=text, name="report-scale-graph-section", width=_WIDTH, stylesheets=[data.css])
    return [head, fig]
