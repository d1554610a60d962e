"""`ScaledArray`: a tensor stored as ``data * scale``.

The data carries the low-precision payload (FP8, FP16, BF16 or FP32) and is kept near
unit RMS by the scalify engine; the scale is a float32 scalar, a power of two, that holds
the magnitude. Both are JAX arrays, so a `ScaledArray` is an ordinary pytree that passes
through `jax.jit`, `jax.grad`, optax and flax unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SCALE_DTYPE = jnp.float32


def _check_sign(scale: Any) -> None:
    """A scale known on the host must not be negative: every rule reads ``data * scale``
    with a positive scale (max, argmax, sort, comparisons would be wrong). NaN and 0
    (an exactly-zero tensor) are allowed; a traced scale is not checked."""
    if isinstance(scale, jax.core.Tracer):
        return
    try:
        value = np.asarray(scale)
    except Exception:  # noqa: BLE001 - not an array (a pytree placeholder): no claim
        return
    if value.ndim == 0 and np.issubdtype(value.dtype, np.number) and value < 0:
        raise ValueError(
            f"ScaledArray: the scale must not be negative (got {value.item()}): the value "
            "is data * scale with a positive scale, the sign belongs to the data"
        )


def _float_scale(scale: Any) -> Any:
    """A scale given as a Python number, or as an integer, boolean or float64 array, as
    a float32 one of the same array library (a Python number as a NumPy array): every
    rule takes the scale for a float32 array (``.dtype``, ``is_finite``, log2,
    reciprocals). Float32 and narrower float scales as given."""
    if isinstance(scale, int | float):  # bool included
        return np.asarray(scale, SCALE_DTYPE)
    if isinstance(scale, np.ndarray | np.generic | jax.Array) and (
        jnp.issubdtype(scale.dtype, jnp.integer)
        or scale.dtype == np.bool_
        or scale.dtype == np.float64
    ):  # a NumPy scale stays a NumPy array, a JAX one a JAX array
        xp = jnp if isinstance(scale, jax.Array) else np
        return xp.asarray(scale, SCALE_DTYPE)
    return scale


@jax.tree_util.register_pytree_node_class
class ScaledArray:
    """A tensor represented as ``data * scale`` with a scalar ``scale``.

    ``shape`` and ``dtype`` are those of ``data``: a `ScaledArray` stands for a tensor of
    that shape and dtype, and the scalify engine traces user code on exactly that aval.
    """

    __slots__ = ("data", "scale")
    __array_priority__ = 1000

    def __init__(self, data: Any, scale: Any):
        if isinstance(data, list | tuple):  # nested Python numbers, as np.asarray takes
            data = jnp.asarray(data)
        _check_sign(scale)
        self.data = data
        self.scale = _float_scale(scale)

    @classmethod
    def trusted(cls, data: Any, scale: Any) -> ScaledArray:
        """The engine's constructor: ``data`` and ``scale`` as they are, unchecked (a
        concrete scale would otherwise be read back from the device once per op)."""
        obj = object.__new__(cls)
        obj.data, obj.scale = data, scale
        return obj

    # -- pytree ------------------------------------------------------------------------
    def tree_flatten(self):
        return (self.data, self.scale), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        obj.data, obj.scale = children
        return obj

    # -- array-like metadata -----------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(np.shape(self.data))

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.data.dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def aval(self) -> jax.core.ShapedArray:
        return jax.core.ShapedArray(self.shape, self.dtype)

    def to_array(self, dtype: Any = None) -> jax.Array:
        """The represented value ``data * scale``, computed in float32 (or wider) and
        returned as ``dtype`` (default: the data dtype)."""
        out_dtype = self.dtype if dtype is None else np.dtype(dtype)
        wide = max(wide_float(self.dtype), wide_float(out_dtype), key=lambda d: d.itemsize)
        value = jnp.asarray(self.data).astype(wide) * _batched(self.scale, self.shape).astype(wide)
        return value.astype(out_dtype)

    def astype(self, dtype: Any) -> ScaledArray:
        """The same value with its data cast to ``dtype`` (the scale kept), as
        ``ndarray.astype`` casts an array: values beyond the dtype's range are the cast's."""
        data = self.data if hasattr(self.data, "astype") else jnp.asarray(self.data)
        return ScaledArray(data.astype(dtype), self.scale)  # NumPy data stays NumPy

    def __array__(self, dtype=None, copy=None):
        if dtype is None:
            return np.asarray(self.to_array())
        dtype = np.dtype(dtype)
        if dtype.itemsize == 8:  # float64 (or int64) even where JAX runs without x64
            scale = np.asarray(_batched(self.scale, self.shape), np.float64)
            wide = np.asarray(self.data).astype(np.float64) * scale
            return np.asarray(wide, dtype)
        # computed in the requested dtype: float16 data at a large scale may only be
        # representable in float32
        return np.asarray(self.to_array(dtype))

    def __repr__(self) -> str:
        return f"ScaledArray(data={self.data!r}, scale={self.scale!r})"

    def __neg__(self):
        return _refuse_arithmetic("neg", None)


def _refuse_arithmetic(op: str, other: Any) -> Any:
    if other is not None and not isinstance(other, jax.Array | ScaledArray):
        return NotImplemented
    raise TypeError(
        f"ScaledArray has no arithmetic of its own (`{op}`): compute on it inside a function "
        "under ss.scalify that takes it as an argument (a ScaledArray captured by closure "
        "or read from a global is a constant scalify cannot see), or take its value "
        "first with ss.asarray(x)"
    )


def _arithmetic(op: str):
    return lambda self, other: _refuse_arithmetic(op, other)


# A ScaledArray meeting a JAX array (a tracer, most often: one captured by closure inside
# a scalified function, which scalify never sees) gets an error that says so, not
# Python's "unsupported operand". NumPy operands and numbers are left to NumPy and
# Python, as before (NumPy reads the value through __array__).
for _op in ("add", "sub", "mul", "truediv", "floordiv", "matmul", "pow", "mod"):
    setattr(ScaledArray, f"__{_op}__", _arithmetic(_op))
    setattr(ScaledArray, f"__r{_op}__", _arithmetic(_op))
del _op


def _batched(scale: Any, shape: tuple[int, ...]) -> jax.Array:
    """``scale`` ready to multiply data of ``shape``: a scalar as it is; a scale of shape
    ``S`` (a batch of scaled arrays, as ``jax.vmap`` over a scalified function returns
    them, one scale per example) over the data's leading axes ``S``."""
    scale = jnp.asarray(scale)
    if scale.ndim == 0:
        return scale
    if tuple(shape[: scale.ndim]) != tuple(scale.shape):
        raise ValueError(
            f"ScaledArray: the scale has shape {tuple(scale.shape)}; a scale is a scalar, or "
            f"one per example of a batch along the data's leading axes, but the data has "
            f"shape {tuple(shape)}. (jax.vmap with out_axes other than 0 moves the data's "
            "batch axis away from the scale's: take the value inside the vmapped function "
            "with ss.asarray.)"
        )
    return scale.reshape(scale.shape + (1,) * (len(shape) - scale.ndim))


def wide_float(dtype: Any) -> np.dtype:
    """The dtype scaled arithmetic is computed in: float32, or the dtype itself if wider.

    (8-bit floats have no implicit promotion in JAX, so this is spelled out.)
    """
    dtype = np.dtype(dtype)
    if dtype.itemsize >= 4 and jnp.issubdtype(dtype, jnp.floating):
        return dtype
    return np.dtype(SCALE_DTYPE)


def is_scaled_array(x: Any) -> bool:
    return isinstance(x, ScaledArray)


def _is_float(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return isinstance(x, float)
    return jnp.issubdtype(dtype, jnp.floating)


def _check_scale(scale: Any) -> jax.Array:
    scale = jnp.asarray(scale, dtype=SCALE_DTYPE)
    if scale.ndim != 0:
        raise ValueError(f"ScaledArray scale must be a scalar, got shape {scale.shape}")
    if not isinstance(scale, jax.core.Tracer):
        value = float(scale)
        if not (np.isfinite(value) and value > 0):
            raise ValueError(f"ScaledArray scale must be finite and positive, got {value}")
    return scale


def _norm_scale(arr: jax.Array, norm: str) -> jax.Array:
    from .pow2 import pow2_round_down

    wide = arr.astype(wide_float(arr.dtype))
    if norm == "rms":
        n = jnp.sqrt(jnp.mean(wide * wide))
    elif norm == "max":
        n = jnp.max(jnp.abs(wide))
    else:
        raise ValueError(f"as_scaled_array: scale must be a number, 'rms' or 'max'; got {norm!r}")
    n = pow2_round_down(n).astype(SCALE_DTYPE)
    # An all-zero leaf gets scale 0: "exactly zero, magnitude unknown". The first tensor
    # added to it then sets the scale (Adam moments start at zero).
    return jnp.where(jnp.isfinite(n), n, jnp.ones((), SCALE_DTYPE))


# One compiled program per leaf shape for what follows, instead of one per eager op:
# a model's leaves then take a handful of small compiles, not hundreds.
@jax.jit
def _divided(arr: jax.Array, s: jax.Array) -> jax.Array:
    """``arr / s`` in at least float32, as ``arr``'s dtype (``arr`` itself for s = 0)."""
    wide = wide_float(arr.dtype)
    divisor = jnp.where(s > 0, s, 1.0).astype(wide)
    return (arr.astype(wide) / divisor).astype(arr.dtype)


@functools.partial(jax.jit, static_argnums=1)
def _normalized(arr: jax.Array, norm: str) -> tuple[jax.Array, jax.Array]:
    s = _norm_scale(arr, norm)
    return _divided(arr, s), s


def as_scaled_array(tree: Any, scale: Any = None) -> Any:
    """Turn every floating-point leaf of ``tree`` into a `ScaledArray`.

    ``scale=None``: scale 1, the data is the leaf itself. A number: that scale for every
    leaf, data ``leaf / scale`` in the leaf's dtype (exact for a power of two).
    ``"rms"`` or ``"max"``: per leaf, the power of two (rounded down) of its RMS or
    abs-max, so the data starts at unit scale -- the natural way to bring initialised
    parameters and optimizer state into scalify. An all-zero leaf gets scale 0, which
    rules treat as "exactly zero": the first value added to it sets the scale.
    Integer, bool and non-array leaves, and `ScaledArray` leaves, are returned as is.
    """

    def convert(leaf):
        if isinstance(leaf, ScaledArray) or not _is_float(leaf):
            return leaf
        arr = jnp.asarray(leaf)
        if scale is None:
            return ScaledArray(arr, jnp.ones((), SCALE_DTYPE))
        if isinstance(scale, str):
            return ScaledArray(*_normalized(arr, scale))
        s = _check_scale(scale)
        return ScaledArray(_divided(arr, s), s)

    return jax.tree_util.tree_map(convert, tree, is_leaf=is_scaled_array)


def asarray(tree: Any, dtype: Any = None) -> Any:
    """Replace every `ScaledArray` leaf of ``tree`` by the plain array it represents;
    with ``dtype``, every array leaf (integer ones too, as ``jnp.asarray(x, dtype)``) is
    returned as ``dtype``. Leaves that are not arrays (None, strings) stay as they are."""

    def convert(leaf):
        if isinstance(leaf, ScaledArray):
            return leaf.to_array(dtype)
        if dtype is not None and (hasattr(leaf, "dtype") or _is_float(leaf)):
            return jnp.asarray(leaf, dtype=dtype)
        return leaf

    return jax.tree_util.tree_map(convert, tree, is_leaf=is_scaled_array)
