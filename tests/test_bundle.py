"""`scalescope.analysis.RunAnalysis`: one analysis of a run per reader state, shared by
the report, the notebook conveniences, the CLI verdict and the dashboard; each part
computed once (also when threads ask together), a new bundle once the reader reads new
steps, and every part equal to the function it bundles run on its own."""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from synthetic_run import synthetic_run

import scalescope as ss
from scalescope import analysis as A
from scalescope.analysis import bundle as B
from scalescope.report import collect
from scalescope.store import layout as L

N_OPS, N_STEPS, PART = 100, 160, 40


@pytest.fixture
def run(tmp_path):
    """A synthetic run whose first op (a forward matmul cast to E4M3) overflows E4M3 in
    5 % of its elements at every step: a finding the advisor cannot miss."""
    path = tmp_path / "synthetic"
    synthetic_run(path, N_OPS, N_STEPS, part_steps=PART)
    for part in L.list_parts(path / L.STATS_DIR):
        frame = pq.read_table(part).to_pandas()
        first = (frame["op"] == 0).to_numpy()
        frame.loc[first, "overflow_e4m3"] = np.float32(0.05)
        L.write_parquet_atomic(part, pa.Table.from_pandas(frame, preserve_index=False))
    return path


@pytest.fixture
def counted(monkeypatch):
    """Counts calls of the advisor and the what-if made through the bundle."""
    calls = {"advise": 0, "whatif": 0}
    advise, whatif = B.advise, B.format_whatif

    def count_advise(*args, **kwargs):
        calls["advise"] += 1
        return advise(*args, **kwargs)

    def count_whatif(*args, **kwargs):
        calls["whatif"] += 1
        return whatif(*args, **kwargs)

    monkeypatch.setattr(B, "advise", count_advise)
    monkeypatch.setattr(B, "format_whatif", count_whatif)
    return calls


def test_parts_equal_the_functions_they_bundle(run):
    reader = ss.open_run(run)
    bundle = A.analyse(reader)
    stats = reader.stats(wide=True)
    assert len(bundle.findings) > 0, "the synthetic run drifts and overflows: findings"
    pd.testing.assert_frame_equal(bundle.findings, A.advise(stats, reader.ops, meta=reader.meta))
    pd.testing.assert_frame_equal(
        bundle.whatif, A.format_whatif(stats, reader.ops, meta=reader.meta)
    )
    loss = A.logged_loss(reader.scalar_rows())
    assert bundle.verdict == A.verdict(A.advise(stats, reader.ops, meta=reader.meta), loss)
    pd.testing.assert_frame_equal(bundle.causes, A.causes(bundle.findings))
    pd.testing.assert_frame_equal(bundle.measured, reader.measured())
    assert bundle.formats == ["e4m3", "e5m2", "fp16", "bf16"]
    assert list(bundle.ids) == list(range(N_OPS))


def test_every_view_of_one_reader_shares_one_analysis(run, counted):
    reader = ss.open_run(run)
    findings = reader.advise()  # the notebook's
    verdict = reader.verdict()  # what `scalescope demo` prints
    causes = reader.causes()
    data = collect._collect(reader, A.Thresholds())  # the report's
    with pytest.raises(ValueError, match="no block-scaled recipe"):
        reader.recommend_policy()  # the what-if ran (once): it holds no recipe
    A.format_whatif_run(reader)
    assert counted == {"advise": 1, "whatif": 1}
    pd.testing.assert_frame_equal(pd.DataFrame(findings), data.findings)
    assert verdict == data.verdict
    pd.testing.assert_frame_equal(causes, data.causes)
    # callers get copies: changing one leaves the bundle as it was
    findings["rule"] = "changed"
    assert (A.analyse(reader).findings["rule"] != "changed").all()


def test_other_thresholds_or_audit_get_their_own_analysis(run, counted):
    reader = ss.open_run(run)
    a = A.analyse(reader)
    strict = A.Thresholds(drift_log2=1.0)
    b = A.analyse(reader, thresholds=strict)
    assert a is not b and A.analyse(reader, thresholds=strict) is b
    assert A.analyse(reader, audit=("e4m3",)) is not a
    assert A.analyse(reader) is a
    a.findings, b.findings  # noqa: B018
    assert counted["advise"] == 2
    # options the bundle does not hold run the advisor directly, every time
    A.advise_run(reader, horizon=10)
    A.advise_run(reader, horizon=10)
    assert counted["advise"] == 4


def test_a_refresh_with_new_steps_gives_a_new_analysis(run, counted):
    last = L.list_parts(run / L.STATS_DIR)[-1]
    aside = run / "aside.parquet"
    shutil.move(last, aside)
    reader = ss.open_run(run)
    before = A.analyse(reader)
    first = int(before.stats["step"].max())
    assert first == N_STEPS - PART - 1
    assert reader.refresh() == 0 and A.analyse(reader) is before  # nothing new: kept
    shutil.move(aside, last)
    assert reader.refresh() == 1
    after = A.analyse(reader)
    assert after is not before and after.version > before.version
    assert int(after.stats["step"].max()) == N_STEPS - 1
    assert int(before.stats["step"].max()) == first  # the old one is unchanged
    after.findings  # noqa: B018
    assert counted["advise"] == 1


def test_threads_asking_together_compute_each_part_once(run, counted):
    reader = ss.open_run(run)
    bundle = A.analyse(reader)
    start = threading.Barrier(4)
    got = []

    def ask():
        start.wait()
        got.append(bundle.findings)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counted["advise"] == 1 and all(g is got[0] for g in got)


def test_a_reader_without_a_version_is_never_cached(run):
    class Frozen:
        def __init__(self, reader):
            self.reader = reader
            self.ops, self.meta = reader.ops, reader.meta

        def stats(self, wide=True):
            return self.reader.stats(wide=wide)

        def scalar_rows(self):
            return self.reader.scalar_rows()

    frozen = Frozen(ss.open_run(run))
    assert A.analyse(frozen) is not A.analyse(frozen)
    assert A.analyse(frozen).verdict == A.analyse(ss.open_run(run)).verdict


def test_the_dashboard_reads_the_same_analysis(run):
    from scalescope.app.data import RunData

    data = RunData(run)
    bundle = A.analyse(data.reader)
    assert data.stats is bundle.stats and data.whatif() is bundle.whatif
    assert data.notes() == bundle.notes
    # the advisor's background run: its findings and verdict are those of one analysis
    findings = data.findings()
    assert data.advice.bundle.findings is findings
    assert data.verdict(findings) is data.advice.bundle.verdict
    pd.testing.assert_frame_equal(findings, bundle.findings)
    assert data.verdict(findings) == bundle.verdict
