"""The tables of docs/results.md (the findings) and docs/lab/ (their history) are true at HEAD or say they are not
(#38, #89): every table section names the commit that made it, and ``docs/tables.toml`` lists the page it is on and the
paths its numbers depend on; when one of them changed after that commit the section, and the finding of results.md
that reprints it (``finding``), must carry a "**Stale at HEAD**" line. A later commit reviewed as not moving a table's
numbers is listed in its ``unaffected_by`` with the reason (``unaffected_why``)."""

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STALE = "**Stale at HEAD**"
FINDINGS_MAX_LINES = 600  # results.md is a page of findings; the history is docs/lab/ (#89)


def page_sections() -> dict:
    """``page -> {heading: body}`` for results.md and every page of docs/lab/."""
    pages = ["results.md"] + [f"lab/{p.name}" for p in sorted((ROOT / "docs" / "lab").glob("*.md"))]
    return {p: sections((ROOT / "docs" / p).read_text()) for p in pages}


def places(e: dict, pages: dict) -> list[tuple[str, str, str]]:
    """Where an entry's table is printed: ``(page, heading, body)`` for its own section and its finding's."""
    page = e.get("page", "results.md")
    out = [(page, e["section"], pages[page].get(e["section"]))]
    if e.get("finding"):
        out.append(("results.md", e["finding"], pages["results.md"].get(e["finding"])))
    return out


def manifest() -> dict:
    return tomllib.loads((ROOT / "docs" / "tables.toml").read_text())


def sections(text: str) -> dict:
    """Heading text -> the section's body, for every ``##`` / ``###`` heading (a ``###`` section's body stops at the
    next heading of any level)."""
    parts = re.split(r"^(#{2,3}) (.+)$", text, flags=re.M)
    return {parts[i + 1].strip(): parts[i + 2] for i in range(1, len(parts) - 1, 3)}


def table_paths(entry: dict, groups: dict) -> list[str]:
    out = list(entry.get("paths", []))
    for g in entry.get("groups", []):
        out += groups[g]
    return sorted(set(out))


def changed_since(commit: str, paths: list[str], unaffected=()) -> list[str] | None:
    """The paths among ``paths`` changed after ``commit`` — by a later commit not listed in ``unaffected`` (commits
    reviewed as not moving the table's numbers) or in the working tree; ``None`` without git history."""
    ok = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True)
    if ok.returncode != 0:
        return None
    log = subprocess.run(["git", "log", "--no-merges", "--format=%H", f"{commit}..HEAD", "--", *paths], cwd=ROOT, capture_output=True,
                         text=True)
    assert log.returncode == 0, log.stderr
    out = set()
    for c in log.stdout.split():
        if any(c.startswith(u) for u in unaffected):
            continue
        p = subprocess.run(["git", "diff", "--name-only", f"{c}^", c, "--", *paths], cwd=ROOT, capture_output=True,
                           text=True)
        out |= set(p.stdout.split())
    p = subprocess.run(["git", "diff", "--name-only", "HEAD", "--", *paths], cwd=ROOT, capture_output=True, text=True)
    return sorted(out | set(p.stdout.split()))


def test_every_table_section_is_listed_and_names_its_commit():
    m = manifest()
    pages = page_sections()
    listed = set()
    for e in m["table"]:
        assert not e.get("unaffected_by") or e.get("unaffected_why"), f"{e['section']!r}: unaffected_by without a reason"
        assert e.get("page", "results.md") in pages, f"{e['section']!r}: docs/{e.get('page')} does not exist"
        for page, heading, body in places(e, pages):
            assert body is not None, f"docs/tables.toml names a section docs/{page} does not have: {heading!r}"
            assert f"`{e['commit']}" in body, f"docs/{page} {heading!r} does not name its commit {e['commit']}"
            listed.add((page, heading))
        for p in table_paths(e, m["groups"]):
            assert (ROOT / p).exists(), f"{e['section']!r}: {p} does not exist"
    # a section holding a numeric table (a results row) must be in the manifest, on any page
    for page, body in pages.items():
        for name, text in body.items():
            rows = [ln for ln in text.splitlines() if ln.startswith("|") and re.search(r"\d+\.\d+ ± \d", ln)]
            if rows:
                assert (page, name) in listed, f"docs/{page} section {name!r} has a table of results but no " \
                                               "docs/tables.toml entry"


def test_results_md_is_a_page_of_findings_linking_its_history():
    """results.md stays short (the history goes to docs/lab/) and links every lab page it summarises."""
    text = (ROOT / "docs" / "results.md").read_text()
    assert len(text.splitlines()) <= FINDINGS_MAX_LINES
    for p in sorted((ROOT / "docs" / "lab").glob("*.md")):
        assert f"](lab/{p.name}" in text, f"results.md does not link docs/lab/{p.name}"


def test_a_table_whose_code_or_config_changed_says_it_is_stale():
    m = manifest()
    pages = page_sections()
    problems = []
    for e in m["table"]:
        changed = changed_since(e["commit"], table_paths(e, m["groups"]), e.get("unaffected_by", []))
        if changed is None:
            pytest.skip(f"commit {e['commit']} is not in this clone's history (a shallow clone)")
        for page, heading, body in places(e, pages):
            if changed and STALE not in body:
                problems.append(f"docs/{page} {heading!r} (made at {e['commit']}): changed since: {', '.join(changed)}")
    assert not problems, ("tables whose code changed after they were made, without a "
                          f"'{STALE}' line (rerun them, or say so):\n" + "\n".join(problems))


def test_the_check_sees_a_change_and_a_reviewed_commit():
    """The staleness check is not vacuous: the first commit of the history differs from HEAD in a file, and listing
    every commit that touched it as reviewed clears it (what is left is the working tree's own change)."""
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)  # noqa: E731
    first = git("rev-list", "--max-parents=0", "HEAD")
    if first.returncode != 0 or not first.stdout.strip():
        pytest.skip("no git history")
    f = "fedmed/run/experiment.py"
    root = first.stdout.split()[0]
    assert changed_since(root, [f]) == [f]
    every = git("log", "--format=%H", "--", f).stdout.split()
    dirty = git("diff", "--quiet", "HEAD", "--", f).returncode != 0
    assert changed_since(root, [f], every) == ([f] if dirty else [])
