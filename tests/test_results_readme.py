"""results/README.md: every link resolves inside the repo and every results file it names records its commit."""
from __future__ import annotations

import json
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


def linked_files() -> list[Path]:
    text = (RESULTS / "README.md").read_text()
    return [RESULTS / target for target in re.findall(r"\]\(([^)#]+)\)", text)]


def records_commit(path: Path) -> bool:
    if path.suffix == ".json":
        return bool(json.loads(path.read_text()).get("git", {}).get("commit"))
    return bool(re.search(r"commit[= ]|commit \(inferred\)", path.read_text()))


def test_every_link_resolves():
    links = linked_files()
    assert links, "results/README.md links no file"
    missing = [str(p.relative_to(RESULTS)) for p in links if not p.exists()]
    assert not missing, missing


def test_every_named_results_file_records_a_commit():
    runs = [p for p in linked_files() if p.suffix in (".json", ".md") and p.parent != RESULTS]
    for md in runs:
        assert records_commit(md), md
        if md.with_suffix(".json").exists():
            assert records_commit(md.with_suffix(".json")), md.with_suffix(".json")
