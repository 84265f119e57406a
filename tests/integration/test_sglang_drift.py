"""The SGLang stand-in (tests/helpers/sglang_fake.py) against SGLang 0.5.23's own source, read from its wheel.

The wheel is downloaded once by the test command (``pip download --no-deps sglang==0.5.23`` into
``~/.cache/ngramcache/engines/wheels``) and read as a zip file: nothing of it is installed or
imported. Checked: the routes the stand-in serves are the external-corpus routes of
``srt/entrypoints/http_server.py`` with the same methods; the request fields it accepts are those of
``AddExternalCorpusReqInput`` (``srt/managers/io_struct.py``, with its base class's); each route's
answer has the keys the source builds, with 200 on success and 400 otherwise; every message
the stand-in sends is written in the wheel's sources; and what the docs say of SGLang (its routes,
its defaults, a startup corpus past the limit failing the start) is what the wheel's source does.
"""

from __future__ import annotations

import ast
import json
import os
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

import pytest
from helpers.sglang_fake import ADD_FIELDS, FakeSglang

from ngramcache.client.kernel.sglang_corpus import SGLANG_DEFAULT_MAX_TOKENS

VERSION = "0.5.23"
WHEELS = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ngramcache" / "engines" / "wheels"
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
SPEC_ARGS = "sglang/srt/arg_groups/fields/spec.py"
NGRAM_WORKER = "sglang/srt/speculative/ngram_worker.py"
EXTERNAL_CORPUS = "sglang/srt/speculative/cpp_ngram/external_corpus.py"
DOCS = Path(__file__).resolve().parents[2] / "docs"
# The fixed part of every message the stand-in sends, as the source writes it.
MESSAGES = ("Either file_path or documents must be provided.", "External ngram corpus path does not exist",
            "Ngram speculative decoding is not enabled.", "already exists. Remove it before adding a new corpus",
            "exceeds the remaining token budget", "External corpus is empty", "token limit)", "Loaded corpus",
            "Removed corpus", '"Unauthorized"', "corpus_id is required.")


@pytest.fixture(scope="module")
def wheel() -> zipfile.ZipFile:
    found = sorted(WHEELS.glob(f"sglang-{VERSION}-*.whl"))
    if not found:
        pytest.fail(f"no sglang {VERSION} wheel in {WHEELS}: the test command downloads it "
                    f"(pip download --no-deps sglang=={VERSION} -d {WHEELS})")
    return zipfile.ZipFile(found[0])


def source(wheel: zipfile.ZipFile, name: str) -> str:
    return wheel.read(name).decode("utf-8")


def corpus_routes(wheel: zipfile.ZipFile) -> dict[tuple[str, str], list[set[str]]]:
    """{(METHOD, path): the key sets of the JSON answers it builds} for the external-corpus routes."""
    tree = ast.parse(source(wheel, HTTP_SERVER))
    routes: dict[tuple[str, str], list[set[str]]] = {}
    for fn in tree.body:
        if not isinstance(fn, ast.AsyncFunctionDef):
            continue
        for dec in fn.decorator_list:
            if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.func.attr in ("get", "post")
                    and dec.args and isinstance(dec.args[0], ast.Constant) and "external_corp" in str(dec.args[0].value)):
                answers = [{k.value for k in node.args[0].keys if isinstance(k, ast.Constant)}
                           for node in ast.walk(fn) if isinstance(node, ast.Call) and getattr(node.func, "id", "") ==
                           "ORJSONResponse" and node.args and isinstance(node.args[0], ast.Dict)]
                routes[(dec.func.attr.upper(), str(dec.args[0].value))] = answers
    return routes


def class_fields(tree: ast.Module, name: str) -> set[str]:
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    fields = {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    for base in cls.bases:
        if isinstance(base, ast.Name) and any(isinstance(n, ast.ClassDef) and n.name == base.id for n in tree.body):
            fields |= class_fields(tree, base.id)
    return fields


class Words:
    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]


def call(server: FakeSglang, method: str, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_stand_in_serves_sglangs_corpus_routes(wheel: zipfile.ZipFile) -> None:
    routes = corpus_routes(wheel)
    assert set(routes) == {("POST", "/add_external_corpus"), ("POST", "/remove_external_corpus"),
                           ("GET", "/list_external_corpora")}
    with FakeSglang(Words()) as server:
        for method, path in routes:
            status, _ = call(server, method, path, {} if method == "POST" else None)
            assert status != 404, f"the stand-in does not serve {method} {path}"
        assert call(server, "GET", "/no_such_route")[0] == 404


def test_the_stand_in_accepts_the_fields_of_sglangs_request(wheel: zipfile.ZipFile) -> None:
    assert class_fields(ast.parse(source(wheel, IO_STRUCT)), "AddExternalCorpusReqInput") == ADD_FIELDS


def test_each_answer_has_the_keys_and_status_sglang_gives(wheel: zipfile.ZipFile) -> None:
    routes = corpus_routes(wheel)
    text = source(wheel, HTTP_SERVER)
    assert text.count("status_code=200 if result.success else HTTPStatus.BAD_REQUEST") == 3  # 200 or 400, each route
    with FakeSglang(Words(), max_tokens=100) as server:
        ok = call(server, "POST", "/add_external_corpus", {"corpus_id": "a", "documents": ["one two three"]})
        bad = call(server, "POST", "/add_external_corpus", {"documents": []})
        assert (ok[0], bad[0]) == (200, 400)
        assert set(ok[1]) == set(bad[1]) and set(ok[1]) in routes[("POST", "/add_external_corpus")]
        removed = call(server, "POST", "/remove_external_corpus", {"corpus_id": "a"})
        missing = call(server, "POST", "/remove_external_corpus", {})
        assert (removed[0], missing[0]) == (200, 400)
        assert all(set(body) in routes[("POST", "/remove_external_corpus")] for _, body in (removed, missing))
        listed = call(server, "GET", "/list_external_corpora")
        assert listed[0] == 200 and set(listed[1]) in routes[("GET", "/list_external_corpora")]
        unknown_field = call(server, "POST", "/add_external_corpus", {"corpus": "a"})
        assert unknown_field[0] == 400 and "except TypeError as e" in text  # SGLang: the dataclass refuses it, 400


def test_every_message_of_the_stand_in_is_written_in_sglangs_source(wheel: zipfile.ZipFile) -> None:
    sources = "\n".join(wheel.read(n).decode("utf-8", "replace") for n in wheel.namelist()
                        if n.startswith("sglang/") and n.endswith((".py", ".cpp", ".h", ".cc")))
    fake = Path(__file__).resolve().parents[1] / "helpers" / "sglang_fake.py"
    fake_text = fake.read_text()
    for message in MESSAGES:
        assert message in fake_text, f"{message!r} is no longer sent by the stand-in: update MESSAGES"
        assert message in sources, f"SGLang {VERSION}'s source has no {message!r}: the stand-in drifted"


def spec_defaults(wheel: zipfile.ZipFile) -> dict[str, Any]:
    """The server arguments of ``srt/arg_groups/fields/spec.py`` with a constant default: {field: default}."""
    defaults = {}
    for node in ast.walk(ast.parse(source(wheel, SPEC_ARGS))):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(node.value, ast.Constant):
            defaults[node.target.id] = node.value.value
    return defaults


def function_source(wheel: zipfile.ZipFile, name: str, function: str) -> str:
    tree = ast.parse(source(wheel, name))
    found = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function]
    assert len(found) == 1, f"{name}: no single {function}()"
    return ast.unparse(found[0])


def test_what_the_docs_say_of_sglang_is_in_its_source(wheel: zipfile.ZipFile) -> None:
    """docs/engines.md's SGLang section, fact by fact, against the wheel (not against strings written in this
    repository)."""
    engines = " ".join((DOCS / "engines.md").read_text().split())
    metadata = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    assert f"Version: {VERSION}\n" in source(wheel, metadata) and f"SGLang {VERSION}" in engines
    # Corpora change at run time: the three routes, with their methods.
    for method, path in corpus_routes(wheel):
        assert f"{method} {path}" in engines, f"docs/engines.md does not name {method} {path}"
    defaults = spec_defaults(wheel)
    # The SAM budget's default is 0: a corpus is loaded but never drafted from until it is raised.
    assert defaults["speculative_ngram_external_sam_budget"] == 0
    assert "--speculative-ngram-external-sam-budget` at its default, 0" in engines
    # The token limit's default, which the feeder's --max-tokens and export-sglang take as theirs.
    assert defaults["speculative_ngram_external_corpus_max_tokens"] == SGLANG_DEFAULT_MAX_TOKENS == 10_000_000
    assert "(default 10,000,000)" in engines
    # A startup corpus past the limit fails the start, whole (no truncation): the worker loads the startup file
    # through iter_external_corpus_chunks, which raises past the limit.
    assert "iter_external_corpus_chunks(" in function_source(wheel, NGRAM_WORKER, "__init__")
    chunks = function_source(wheel, EXTERNAL_CORPUS, "iter_external_corpus_chunks")
    assert "if next_total_tokens > max_tokens:" in chunks and "raise ValueError(" in chunks
    assert "fail to start" in engines and "SGLang does not truncate it" in engines
    # ... and no page says otherwise.
    for page in [DOCS.parent / "README.md", *sorted(DOCS.glob("*.md"))]:
        flat = " ".join(page.read_text().split())
        assert "loads at most 10M tokens" not in flat, f"{page.name}: SGLang refuses a startup corpus past its limit"
        assert "SGLang does not reload it" not in flat, f"{page.name}: SGLang adds corpora at run time"
