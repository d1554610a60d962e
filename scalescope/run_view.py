"""`RunView`: a recorded run with its conveniences, what ``ss.open_run(path)`` returns.

The run store (`scalescope.store.RunReader`) only reads: frames and series of what was
recorded. The conveniences a notebook user reaches for on an opened run (the advisor's
findings, an inline heatmap, a comparison with another run, the histogram and the scale
graph drawn in Jupyter, the delayed-scaling replay) need the judgement of
`scalescope.analysis` and the figures of `scalescope.viz`, which sit above the store.
They live here, in a subclass of the reader defined above both, so the data flows one
way (store -> analysis -> viz -> notebook -> here; analysis is imported on
use, so ``import scalescope`` stays light) and ``ss.open_run(path).advise()``
keeps working. A `RunView` is a `RunReader` (``isinstance`` holds) with every reader
method and attribute unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import pandas as pd

from . import notebook as nb
from .store import RunReader
from .store.reader import OpsArg


class RunView(RunReader):
    """A run directory opened by `open_run`: the `RunReader` plus inline views."""

    def hist(self, op: int | str, step: int = -1, iteration: int | None = None) -> pd.Series:
        """`RunReader.hist` as a `scalescope.notebook.HistSeries`: the same counts, drawn
        in Jupyter with each format's range shaded."""
        series = super().hist(op, step, iteration)
        return nb.hist_series(series, nb.format_limits(self.formats, self.meta))

    def scale_graph(self, step: int | None = None) -> pd.DataFrame:
        """`RunReader.scale_graph` as a `scalescope.notebook.ScaleGraph`: the same frame,
        drawn in Jupyter with the run's formats (``attrs``: step, formats)."""
        frame = super().scale_graph(step)
        formats = [f for f in self.formats if f != "fp32"]
        return nb.scale_graph_frame(frame, step=frame.attrs["step"], formats=formats)

    def delayed_scaling(
        self,
        op: int | str,
        history: int = 1024,
        algo: str = "max",
        margin: float = 0,
        fmt: str = "e4m3",
        process: int | None = 0,
        iteration: int | None = None,
    ) -> pd.DataFrame:
        """What FP8 delayed scaling (TE / Flax style: the scale from an amax history of
        ``history`` recorded steps, ``algo`` ``"max"`` or ``"most_recent"``, ``margin``)
        would have clipped of ``op`` (an id or ``pass/name``, as for `hist`) at each
        recorded step, from its recorded abs-max, scale and exponent histogram: see
        `scalescope.analysis.delayed.delayed_scaling` for the columns. The history holds
        recorded steps only (``every=10``: every 10th step; the ``gap`` column).

        ``iteration``: rows of that loop iteration only (e.g. one layer of a scan over
        layers, which would own its FP8 history); None: the iterations of a step share
        one history (their amax is the max, their clipped counts add up).
        ``process``: rows of that JAX process (None: all, treated like iterations)."""
        from .analysis import delayed_scaling_run

        return delayed_scaling_run(
            self,
            op,
            history=history,
            algo=algo,
            margin=margin,
            fmt=fmt,
            process=process,
            iteration=iteration,
        )

    def advise(self, **kwargs: Any) -> pd.DataFrame:
        """The advisor's findings for this run (see `scalescope.analysis.advise`; keyword
        arguments such as ``thresholds`` or ``audit`` pass through). A ``pd.DataFrame``
        (`scalescope.notebook.Advice`) that Jupyter shows coloured by severity."""
        from .analysis import advise_run

        return nb.advice_frame(advise_run(self, **kwargs))

    def verdict(self, **kwargs: Any) -> Any:
        """The run's verdict (`scalescope.analysis.Verdict`): ``healthy``, ``at risk`` or
        ``failing``, the top causes (op, source line, fix) and the step where it turned.
        Keyword arguments pass to `scalescope.analysis.verdict_run` (``audit``,
        ``thresholds``, ``loss``: the logged scalar holding the loss)."""
        from .analysis import verdict_run

        return verdict_run(self, **kwargs)

    def recommend_policy(self, **kwargs: Any) -> Any:
        """A precision policy from this run's what-if (`scalescope.Policy`): each matmul
        operand in its cheapest safe recorded recipe, BF16 where none is safe, merged
        across layers (`scalescope.analysis.recommend_policy`; keyword arguments pass
        through). Check it with ``scalescope verify RUN --policy FILE``."""
        from .analysis import recommend_policy_run

        return recommend_policy_run(self, **kwargs)

    def predict_policy(self, policy: Any) -> pd.DataFrame:
        """What this run's what-if predicts for ``policy``: one row per value it reaches
        (label, target, safe, reason; `scalescope.analysis.predict_policy`)."""
        from .analysis import predict_policy_run
        from .core.policy import as_policy

        return predict_policy_run(self, as_policy(policy))

    def causes(self, **kwargs: Any) -> pd.DataFrame:
        """The advisor's findings grouped into one row per cause (rule, format, pass and
        module), most severe and largest impact first (`scalescope.analysis.causes`);
        keyword arguments pass to `advise`."""
        from .analysis import advise_run, analyse, causes

        if set(kwargs) <= {"thresholds", "audit"}:
            return analyse(self, **kwargs).causes.copy()
        return causes(advise_run(self, **kwargs))

    def heatmap(
        self,
        metric: str = "log2_rms",
        ops: OpsArg = None,
        *,
        iterations: str = "max",
        max_steps: int = 500,
        group_depth: int = 1,
        expanded: Sequence[str] | None = None,
    ) -> Any:
        """Op x step heatmap of ``metric`` (recorded or derived, e.g. ``log2_rms``) that
        displays inline in Jupyter; ``.matrix`` holds the data, ``.figure`` the Bokeh
        figure. ``ops``: see `resolve_ops`; ``iterations``, ``max_steps``: see
        `scalescope.analysis.matrix`; rows grouped by module path at ``group_depth`` (0:
        one row per op), ``expanded``: the groups shown op by op (None: every group of a
        small run, none of a large one). Returns a `scalescope.notebook.HeatmapView`."""
        return nb.run_heatmap(
            self, metric, ops, iterations=iterations, max_steps=max_steps,
            group_depth=group_depth, expanded=expanded,
        )  # fmt: skip

    def compare(self, other: RunReader | str | os.PathLike, metric: str = "value_rms") -> Any:
        """This run (a) against ``other`` (b, a reader or a run path), displayed inline:
        summary (final loss, findings, safe ops per format), loss curves and the per-op
        log2 ratio of ``metric`` (default the values' RMS, data RMS times scale, which
        compares a scalified run with a plain one; ``"rms"``: the data's). ``.values`` /
        ``.unmatched`` hold the data (`scalescope.analysis.compare_readers`). Returns a
        `scalescope.notebook.ComparisonView`."""
        return nb.compare_runs(self, other, metric)


def open_run(path: str | os.PathLike) -> RunView:
    """Open a run directory for reading (``ss.open_run``): a `RunView`, i.e. a
    `scalescope.store.RunReader` with the conveniences above. Clear errors for a missing
    path, a file, or a directory that is not a run (pointing at `list_runs` when it holds
    runs)."""
    return RunView(path)
