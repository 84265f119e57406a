"""The README's Python snippet runs as written, from an empty folder."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_links_stay_inside_the_repository():
    root = README.parent
    for doc in [README, *sorted((root / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)", doc.read_text()):
            assert not target.startswith(("http:", "https:", "/")), f"{doc.name} links outside: {target}"
            assert (doc.parent / target).resolve().is_relative_to(root), f"{doc.name}: {target}"
            assert (doc.parent / target).exists(), f"{doc.name}: broken link {target}"


def test_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 250, "README.md is the front page: measurements go to docs/benchmarks.md"
    for page in ("docs/benchmarks.md", "docs/api.md", "docs/engines.md", "docs/python.md", "docs/cli.md"):
        assert f"]({page}" in text, f"README.md does not link {page}"


def test_benchmark_commands_name_scripts_that_exist():
    root = README.parent
    for doc in [README, *sorted((root / "docs").glob("*.md"))]:
        for script in re.findall(r"tests/bench/[\w/]+\.py", doc.read_text()):
            assert (root / script).exists(), f"{doc.name} names {script}, which does not exist"


def test_docs_refer_to_measurements_where_they_are():
    # The measurement tables live in docs/benchmarks.md, not in the README.
    root = README.parent
    for doc in [*sorted((root / "docs").glob("*.md")), root / "tests" / "bench" / "README.md"]:
        text = doc.read_text()
        assert not re.search(r'README(\.md)?,? "(Measured|llama-server|Fleet history)', text), \
            f"{doc.name} sends readers to a README section that moved to docs/benchmarks.md"
        assert "README's \"Measured\"" not in text and "The README gives the measured" not in text, doc.name


def test_the_fleet_quickstart_starts_the_redis_it_uses():
    """`serve --counts redis://127.0.0.1:6379` alone left a new user without a Redis, looping on 'unreachable'."""
    text = README.read_text()
    block = re.search(r"## Quickstart: a fleet with Redis\n\n```bash\n(.*?)```", text, re.S)
    assert block, "README: no bash block under 'Quickstart: a fleet with Redis'"
    lines = block.group(1).splitlines()
    serve = next(i for i, line in enumerate(lines) if "ngramcache serve --counts redis://127.0.0.1:" in line)
    port = re.search(r"redis://127\.0\.0\.1:(\d+)", lines[serve]).group(1)
    assert any(line.startswith(f"redis-server --port {port} ") for line in lines[:serve]), lines
