"""The ``stall`` rule: updates that a held format rounds away.

A precision policy that holds a step's state in a narrow format (FP8 master weights,
16-bit Adam moments) rounds each leaf as the step reads it; an update under half the
format's spacing at the value leaves the held value where it was. The tracked step
measures it at each recorded step (`scalescope.store.updates`; `RunReader.held_updates`):
``lost / moved`` is the share of the elements the step moved whose held value did not
change. Nothing in the value's own statistics shows it: weights sit well inside E4M3 at
30 dB SNR while their training has stopped. The rule judges the median share over the
recorded steps, per held leaf and over every held leaf together (`_stall_findings`)"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ..percent import pct
from ..thresholds import Thresholds
from .text import _steps_text


def _stall_findings(
    updates: pd.DataFrame | None, table: pd.DataFrame, thresholds: Thresholds
) -> list[dict[str, Any]]:
    """One ``stall`` finding per held leaf whose share of updates lost, the median over
    the recorded steps, exceeds ``thresholds.stall``. The median, not the worst step: a
    training converging on its data takes smaller steps, and a late step that loses
    most of them is no stall. ``value``: that median share; ``impact`` (``_share``): the
    same median over every held value together, the share of the model's updates
    lost, which grades the finding with it (a small leaf such as a norm's scale, near
    1 where the spacing is widest, may lose half of its updates while the model trains
    as well as in fp32: `severity_level`)."""
    if updates is None or not len(updates):
        return []
    frame = updates[updates["op"].isin(table.index) & (updates["moved"] > 0)]
    if not len(frame):
        return []
    every = frame.groupby("step")[["moved", "lost"]].sum()
    model = float(np.median(every["lost"].to_numpy() / every["moved"].to_numpy()))
    rows: list[dict[str, Any]] = []
    for op, g in frame.groupby("op", sort=True):
        g = g.sort_values("step")
        share = g["lost"].to_numpy(np.float64) / g["moved"].to_numpy(np.float64)
        sustained = float(np.median(share))
        hit = share > thresholds.stall
        if not sustained > thresholds.stall:
            continue
        steps = g["step"].to_numpy(np.int64)
        worst = int(np.argmax(share))
        fmt = str(table.at[op, "cast_to"]) or ""
        held = f"held in {fmt}" if fmt else "as held"
        text = (
            f"{pct(sustained)} of the elements a step updates round back to their value "
            f"{held} (median over {len(g)} recorded steps, {pct(share[worst])} at step "
            f"{steps[worst]}): their update is lost; over every held value, "
            f"{pct(model)} of the updates are"
        )
        first = int(steps[hit][0])
        rows.append(
            dict(
                op=int(op),
                rule="stall",
                format=fmt,
                first_step=first,
                steps=int(hit.sum()),
                value=sustained,
                threshold=float(thresholds.stall),
                evidence=f"{text}; {_steps_text(int(hit.sum()), len(g), first)}.",
                _at=int(steps[worst]),
                _share=model,
            )
        )
    return rows
