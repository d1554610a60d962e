"""Values that span several JAX processes: bring a recorded value to this host, find a
step's global mesh, keep statistics replicated, and agree on a multi-process run's
first step (one collective). What `Run` and `Tracked` need to record one run from every
process of a ``jax.distributed`` job."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from . import layout as L


def to_host(x: Any) -> np.ndarray:
    """A device array as NumPy; for an array that spans several processes (a global
    array), this process's replica of it, which must then hold the whole value."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if not x.is_fully_replicated:
            raise L.RunError(
                f"a recorded value of shape {x.shape} is split over several processes "
                f"({x.sharding}); scalescope records values replicated on every device"
            )
        x = x.addressable_data(0)
    return np.asarray(x)


def is_global(tree: Any) -> bool:
    """Whether ``tree`` holds an array that spans devices of several processes (a
    global value, the same in every process) rather than this process's own."""
    return any(
        isinstance(leaf, jax.Array) and not leaf.is_fully_addressable
        for leaf in jax.tree.leaves(tree)
    )


def global_mesh(tree: Any) -> jax.sharding.Mesh | None:
    """The mesh of the first array of ``tree`` laid out over devices of several
    processes (a step jitted over a global mesh), or None."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if (
            isinstance(leaf, jax.Array)
            and isinstance(sharding, jax.sharding.NamedSharding)
            and not leaf.is_fully_addressable
        ):
            return sharding.mesh
    return None


def replicated(tree: Any, mesh: jax.sharding.Mesh | None) -> Any:
    """``tree`` constrained (inside a jitted function) to be replicated on every device
    of ``mesh``, so each process holds the whole statistics; unchanged without a mesh."""
    if mesh is None:
        return tree
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.lax.with_sharding_constraint(tree, sharding)


def agree_across_processes(process: int, last_step: int, start_step: int | None) -> int:
    """Check the process indices that the writers of a multi-process run claim and agree
    on its first step; returns that step. Every JAX process calls it once, at the same
    point (one collective, `jax.experimental.multihost_utils.process_allgather`), so a
    bad claim raises `RunError` in every process instead of leaving the others waiting.

    ``process``: the index this writer claims; ``last_step``: the last step this process
    found in the run (-1: none); ``start_step``: the one it was asked for, or None.
    The claims must be 0 .. process_count - 1, each once; explicit start steps must be
    the same in every process; otherwise the run starts one past the last step found.
    """
    from jax.experimental import multihost_utils

    mine = np.array([process, last_step, -1 if start_step is None else start_step], np.int64)
    rows = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 3)
    return agreed_start(rows)


def agreed_start(rows: np.ndarray) -> int:
    """The first step of a multi-process session from every process's ``[claimed
    process index, last step found, explicit start step or -1]`` (row k: JAX process k);
    `RunError` when the claims or the explicit start steps disagree."""
    n = len(rows)
    claims = [int(c) for c in rows[:, 0]]
    if sorted(claims) != list(range(n)):
        detail = ", ".join(f"JAX process {k} as {c}" for k, c in enumerate(claims))
        raise L.RunError(
            f"Run: the {n} JAX processes must record as processes 0..{n - 1}, one each; "
            f"they claim: {detail} (leave process_index unset: it defaults to "
            "jax.process_index())"
        )
    starts = {int(s) for s in rows[:, 2]}
    if starts == {-1}:
        return int(rows[:, 1].max()) + 1
    if len(starts) > 1:
        raise L.RunError(
            f"Run: the JAX processes ask for different start_step values "
            f"({sorted(s for s in starts if s >= 0)}, -1: unset); pass the same in every process"
        )
    return starts.pop()


def start_copy(tree: Any) -> None:
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            try:
                leaf.copy_to_host_async()
            except Exception:  # noqa: BLE001 - a hint only; np.asarray copies anyway
                pass
