"""The ``--compile-cache`` option of the benchmarks that time compiles.

They turn JAX's persistent compilation cache off by default: a cache hit would be timed
as a compile. Smoke runs (the tests) pass ``--compile-cache`` to keep it, so the programs
the benchmarks share with each other compile once per machine; their compile figures are
then not fresh compiles.
"""

from __future__ import annotations

import argparse

import jax


def add_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compile-cache",
        action="store_true",
        help="keep JAX's persistent compilation cache on (smoke runs: compile times printed "
        "are then not fresh compiles)",
    )


def apply(args: argparse.Namespace) -> None:
    """Turn the persistent compilation cache off unless ``--compile-cache`` was given."""
    if not args.compile_cache:
        jax.config.update("jax_enable_compilation_cache", False)
