"""Block-scaled recipes: the scaling rules real FP8/FP4 training applies before a cast.

A *format* casts each element as it is. A *recipe* first divides a block of elements by
a shared dequantisation scale ``X`` chosen from the block's abs-max, then casts: the
probe reports what that would do to every recorded value (docs/probe.md, "Block-scaled
recipes"). The rules, with ``amax_b`` a block's finite abs-max and ``amax`` the tensor's:

- ``tensor``: one block; ``s = f32(448 / amax)``, ``X = 1/s`` (TE current scaling).
  Where ``448 / amax`` overflows float32 (``amax`` below ~1.3e-36), ``s`` is float32's
  largest finite value, as in Transformer Engine; NVFP4's ``S_enc`` likewise.
- ``mx_floor``: ``X = 2^clamp(floor(log2 amax_b) - emax_elem, -127, 127)`` (OCP MX v1.0,
  an E8M0 scale); the block max can land up to 12.5 % above an E4M3 element's max and
  saturates.
- ``mx_rceil``: ``X = 2^clamp(ceil(log2(amax_b / max_elem)), -127, 127)``: never clips.
- ``nvfp4``: ``S_enc = f32(448 * 6 / amax)``; block scale ``s_b = RN_e4m3(amax_b / 6 *
  S_enc)``; ``X = s_b / S_enc`` (a block whose ``s_b`` rounds to 0 quantises to 0).
- ``pow2_floor``: ``X = 2^-E``, ``E`` the largest integer with ``amax_b * 2^E <= max_elem``
  (DeepSeek-V3 / TE block scaling), per 128 elements or per 128x128 tile.

Products and quotients by a scale are exact, then rounded once to the element format
(round to nearest even, saturating at its max).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import ml_dtypes

from . import formats as _formats
from .formats import Format

#: Statistics of each recipe R, published as ``<stat>_<R>``.
RECIPE_STATS = (
    "underflow",
    "overflow",
    "snr",
    "block_flush",
    "scale_log2_min",
    "scale_log2_max",
)

#: Scale rules (the kernels' integer codes follow this order).
RULES = ("tensor", "mx_floor", "mx_rceil", "nvfp4", "pow2_floor")

E2M1 = _formats._from_dtype("e2m1", ml_dtypes.float4_e2m1fn)


@dataclass(frozen=True)
class Recipe:
    """A block-scaled recipe: element format, block shape and scale rule.

    ``block`` elements per block along the block axis (0: the whole tensor is one
    block); ``rows`` > 1 makes blocks 2-D tiles of ``rows`` x ``block`` over the
    block axis and the axis before it. ``emax`` is the element format's largest
    exponent, used by the MX rules."""

    name: str
    element: Format
    rule: str
    block: int
    rows: int = 1

    @property
    def emax(self) -> int:
        return self.element.max_exponent

    @property
    def rule_code(self) -> int:
        return RULES.index(self.rule)

    @property
    def bits(self) -> int:
        """Bits per element (the advisor prefers fewer)."""
        return 1 + self.element.exponent_bits + self.element.mantissa_bits

    @property
    def per_tensor(self) -> bool:
        return self.block == 0

    def stat_names(self) -> tuple[str, ...]:
        return tuple(f"{s}_{self.name}" for s in RECIPE_STATS)


_E4M3, _E5M2 = _formats.get("e4m3"), _formats.get("e5m2")

RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("e4m3_tensor", _E4M3, "tensor", 0),
        Recipe("mxfp8_e4m3", _E4M3, "mx_floor", 32),
        Recipe("mxfp8_e5m2", _E5M2, "mx_floor", 32),
        Recipe("mxfp8_e4m3_rceil", _E4M3, "mx_rceil", 32),
        Recipe("mxfp8_e5m2_rceil", _E5M2, "mx_rceil", 32),
        Recipe("mxfp4", E2M1, "mx_floor", 32),
        Recipe("nvfp4", E2M1, "nvfp4", 16),
        Recipe("fp8_block128", _E4M3, "pow2_floor", 128),
        Recipe("fp8_block128x128", _E4M3, "pow2_floor", 128, rows=128),
    )
}


def names() -> tuple[str, ...]:
    return tuple(RECIPES)


def is_recipe(name: object) -> bool:
    return isinstance(name, str) and name.lower() in RECIPES


def get(name: str) -> Recipe:
    """Look a recipe up by name (``"mxfp8_e4m3"``)."""
    if isinstance(name, Recipe):
        return name
    key = name.lower() if isinstance(name, str) else name
    if key not in RECIPES:
        raise KeyError(f"unknown recipe {name!r}; known recipes: {', '.join(RECIPES)}")
    return RECIPES[key]


def format_names(formats: str | Iterable[Any]) -> list[Any]:
    """The entries of a ``formats=`` argument: a string is one name or several separated
    by commas (``"e4m3, nvfp4"``, as the CLI's ``--formats`` takes them), stripped;
    anything else is listed as it is."""
    if isinstance(formats, str):
        return [n.strip() for n in formats.split(",") if n.strip()]
    return list(formats)


def split(names_: str | Iterable[Any]) -> tuple[tuple[Format, ...], tuple[Recipe, ...]]:
    """Split ``formats=`` names (see `format_names`) into plain formats and recipes (in
    the given order), with one error naming every unknown entry (KeyError); a string
    naming nothing, or a format given twice, is a ValueError."""
    given = names_
    names_ = format_names(given)
    if isinstance(given, str) and not names_:
        raise ValueError(f"formats: no format or recipe named in {given!r}")
    fmts, recs, bad = [], [], []
    for n in names_:
        if is_recipe(n) or isinstance(n, Recipe):
            recs.append(get(n))
            continue
        try:
            fmts.append(_formats.get(n))
        except KeyError:
            bad.append(n)
    if bad:
        raise KeyError(
            f"unknown format or recipe {', '.join(map(repr, bad))}; formats: "
            f"{', '.join(_formats.names())}; recipes: {', '.join(RECIPES)}"
        )
    canonical = [f.name for f in fmts] + [r.name for r in recs]
    if len(set(canonical)) != len(canonical):
        raise ValueError(f"formats lists a format twice: {canonical}")
    return tuple(fmts), tuple(recs)
