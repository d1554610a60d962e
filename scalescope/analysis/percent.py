"""Fractions as short percentages (`pct`), the way the advisor's evidence, the format
what-if's reasons, the report and the dashboard write them. A leaf: it imports nothing
of scalescope."""

from __future__ import annotations


def pct(fraction: float) -> str:
    """A fraction as a short percentage: ``0.003 -> '0.3%'``, ``2e-6 -> '0.0002%'``."""
    value = 100.0 * float(fraction)
    if value == 0 or value >= 0.1:
        return f"{value:.1f}%"
    return f"{value:.2g}%"
