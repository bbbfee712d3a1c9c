"""The manual and its front page: the MkDocs site builds with --strict (no broken link or anchor,
no page left out of nav), the README stays a front page whose links resolve, and the code cites
the design page that is in the repository."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 200
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=config.parent, env=env, capture_output=True, text=True, timeout=120)


def test_site_builds_strict(tmp_path):
    built = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "design" / "index.html").exists()


def test_strict_build_fails_on_broken_links_and_pages_outside_nav(tmp_path):
    """The check above can fail: the same configuration over a page with a missing target, a
    missing anchor, and a page nav does not list."""
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[gone](gone.md) [anchor](index.md#no-such-heading)\n")
    (docs / "stray.md").write_text("# Not in nav\n")
    built = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    out = built.stdout + built.stderr
    assert built.returncode != 0
    assert "gone.md" in out and "no-such-heading" in out and "stray.md" in out


def test_every_docs_page_is_in_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert pages and all(re.search(rf":\s*{re.escape(p)}\s*$", nav, re.M) for p in pages), pages


def readme_links() -> list[str]:
    return LINK.findall((ROOT / "README.md").read_text())


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    # the two set-up commands (.ci/run calls make test) and what they install stay on the front page
    assert "make demo" in text and "make test" in text and "pagedecode[test]" in text


def test_readme_links_resolve():
    links = readme_links()
    assert links
    for link in links:
        if re.match(r"[a-z]+:", link):        # an absolute URL: not a file of this repository
            continue
        target = (ROOT / link.split("#", 1)[0]).resolve()
        assert target.is_file(), f"README links to {link}, which does not exist"


def test_code_cites_the_design_page_in_the_repository():
    """The contract lives in docs/design.md; no source file names a design file outside the tree."""
    outside = "DESIGN" + ".md"
    tracked = subprocess.run(["git", "ls-files", "pagedecode", "csrc", "tests", "benchmarks"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()   # not ignored caches
    cited = [name for name in tracked if Path(name).suffix in (".py", ".cpp", ".h", ".md", ".sh")
             and outside in (ROOT / name).read_text(errors="replace")]
    assert cited == []


def module_map() -> dict[str, set[str]]:
    """docs/modules.md as {folder: the file names listed under its `## folder/` heading}."""
    listed: dict[str, set[str]] = {}
    folder = None
    for line in (ROOT / "docs" / "modules.md").read_text().splitlines():
        if line.startswith("## "):
            folder = line[3:].strip().rstrip("/")
            listed[folder] = set()
        elif folder is not None and line.startswith("- `"):
            listed[folder].add(line[3:line.index("`", 3)])
    return listed


def test_module_map_lists_every_module():
    """Each module of pagedecode/ and each source of csrc/ has its line under its folder's heading
    (an empty __init__.py aside): a file that moves or appears must move or appear there too."""
    listed = module_map()
    files = [p for p in (ROOT / "pagedecode").rglob("*.py") if p.name != "__init__.py" or p.read_text().strip()]
    files += [p for p in (ROOT / "csrc").iterdir() if p.suffix in (".cpp", ".h", ".cu")]
    missing = [str(p.relative_to(ROOT)) for p in files
               if p.name not in listed.get(p.parent.relative_to(ROOT).as_posix(), set())]
    assert missing == [], f"not in docs/modules.md: {missing}"
    gone = [f"{folder}/{name}" for folder, names in listed.items() if (ROOT / folder).is_dir()
            for name in names if not (ROOT / folder / name).exists()]
    assert gone == [], f"docs/modules.md lists files that do not exist: {gone}"
