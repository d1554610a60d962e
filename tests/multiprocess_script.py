"""One JAX process of a data-parallel training run recorded by scalescope, for
``test_multiprocess.py``: a tiny MLP trained for a few SGD steps on a global batch sharded
along the batch axis over a mesh of every process's CPU devices, every step recorded into
one run directory, the loss logged, and the scale graph recorded at the end; then, in
RUN_DIR/../../incident/dp, one step that overflows on an example of the last process.

Usage::

    python multiprocess_script.py RUN_DIR STEPS PROCESS_ID NUM_PROCESSES PORT [CLAIM]
    python multiprocess_script.py RUN_DIR STEPS single

The first form joins a ``jax.distributed`` run with its coordinator on 127.0.0.1:PORT
(process 0 hosts it); CLAIM, when given, is passed as ``process_index`` (a wrong claim
must fail in every process). The second trains the same steps on the same global batch
in one process on one device: the reference the test compares the statistics with.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

BATCH, D_IN, D_HIDDEN, D_OUT = 8, 16, 32, 4


def global_data() -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Initial parameters and the global batch, the same in every process."""
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(0, D_IN**-0.5, (D_IN, D_HIDDEN)).astype(np.float32),
        "w2": rng.normal(0, D_HIDDEN**-0.5, (D_HIDDEN, D_OUT)).astype(np.float32),
    }
    x = rng.normal(0, 1, (BATCH, D_IN)).astype(np.float32)
    y = rng.normal(0, 1, (BATCH, D_OUT)).astype(np.float32)
    return params, x, y


def step(params, x, y):
    """One SGD step of a two-layer MLP on a mean squared error; returns (params, loss)."""

    def loss_fn(p):
        h = jax.nn.relu(x @ p["w1"])
        return jnp.mean((h @ p["w2"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    with jax.named_scope("opt"):
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    return params, loss


def place(params, x, y, mesh: Mesh | None):
    """The arguments as global arrays: parameters replicated, the batch split along its
    first axis over the mesh (each process holds its rows only); one device without a
    mesh."""
    if mesh is None:
        return jax.device_put((params, x, y), jax.devices()[0])
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def put(a: np.ndarray, sharding: NamedSharding) -> jax.Array:
        return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

    return (
        jax.tree.map(lambda a: put(a, replicated), params),
        put(x, rows),
        put(y, rows),
    )


def main() -> None:
    path, steps = sys.argv[1], int(sys.argv[2])
    mesh, claim = None, None
    if sys.argv[3] != "single":
        process_id, num_processes, port = (int(a) for a in sys.argv[3:6])
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=120,
        )
        assert jax.process_count() == num_processes, jax.process_count()
        mesh = Mesh(np.array(jax.devices()), ("data",))
        claim = int(sys.argv[6]) if len(sys.argv) > 6 else None
    import scalescope as ss  # after jax.distributed.initialize: it reads process_index()

    params, x, y = place(*global_data(), mesh)
    with ss.Run(path, every=1, flush_steps=2, process_index=claim) as run:
        tracked = run.track(step)
        for i in range(steps):
            params, loss = tracked(params, x, y)
            run.log(i, loss=loss)
        # The scale graph of the last parameters on the global batch: process 0 writes it.
        run.scale_graph(steps, lambda p: step(p, x, y)[1], params)
    if mesh is not None:
        # A step whose loss overflows on one example of process 1's rows: the incident
        # (every process replays it) names the device of process 1.
        params, x, y = global_data()
        x[BATCH - 3, 0] = 1e30
        incident_run = os.path.join(os.path.dirname(os.path.dirname(path)), "incident", "dp")
        with ss.Run(incident_run, every=1000, process_index=claim) as run:
            run.track(step)(*place(params, x, y, mesh))
    print(f"process {jax.process_index()} done", flush=True)


if __name__ == "__main__":
    main()
