"""The habits a release relies on: the pre-commit hooks, the changelog, the version.

Each is a file a person edits by hand next to another it must agree with: the
hooks with the Makefile, the changelog's newest release with pyproject's
fallback_version. These tests read both sides; none builds anything.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]

# Keep a Changelog 1.1.0: the groups a release may have, in this order.
CHANGE_GROUPS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")
RELEASE_HEADING = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$")


def make_recipe(target: str) -> list[str]:
    """The commands of one Makefile target, with $(VENV) as the default it names."""
    makefile = (REPO / "Makefile").read_text()
    venv = re.search(r"^VENV \?= (\S+)$", makefile, re.M)
    assert venv, "the Makefile sets no VENV"
    recipe = re.search(rf"^{target}:[^\n]*\n((?:\t[^\n]*\n)+)", makefile, re.M)
    assert recipe, f"the Makefile has no {target} target"
    return [line.strip().replace("$(VENV)", venv[1]) for line in recipe[1].splitlines()]


def system_hooks() -> list[dict[str, Any]]:
    """The pre-commit hooks that run a command of the project's venv."""
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    hooks = [hook for repo in config["repos"] for hook in repo["hooks"]]
    return [hook for hook in hooks if hook["language"] == "system"]


def changelog_headings() -> list[str]:
    """Every level-2 and level-3 heading of CHANGELOG.md, in order."""
    text = (REPO / "CHANGELOG.md").read_text()
    return [line for line in text.splitlines() if line.startswith(("## ", "### "))]


def released_versions() -> list[tuple[int, ...]]:
    """The versions of the changelog's releases, newest first as written."""
    found = (RELEASE_HEADING.match(heading) for heading in changelog_headings())
    return [tuple(int(part) for part in match[1].split(".")) for match in found if match]


def test_pre_commit_runs_what_make_lint_and_typecheck_run() -> None:
    """The pre-commit hooks are make lint's and make typecheck's commands, in their order."""
    hooks = system_hooks()
    commands = [" ".join([hook["entry"], *hook.get("args", [])]) for hook in hooks]
    assert commands == make_recipe("lint") + make_recipe("typecheck")
    assert all(hook.get("pass_filenames") is False for hook in hooks), "each runs on the tree"


def test_changelog_opens_with_unreleased_then_dated_releases() -> None:
    """CHANGELOG.md is Keep a Changelog: [Unreleased] first, then `[X.Y.Z] - date` releases."""
    releases = [h for h in changelog_headings() if h.startswith("## ")]
    assert releases[0] == "## [Unreleased]"
    assert all(RELEASE_HEADING.match(heading) for heading in releases[1:]), releases


def test_changelog_releases_run_newest_first() -> None:
    """Each release in CHANGELOG.md is older than the one above it."""
    versions = released_versions()
    assert versions, "CHANGELOG.md has no release"
    assert versions == sorted(versions, reverse=True)


def test_changelog_groups_changes_under_the_standard_headings() -> None:
    """Changes sit under Added, Changed, Deprecated, Removed, Fixed or Security, in that order."""
    groups: list[str] = []
    for heading in [*changelog_headings(), "## end"]:
        if heading.startswith("### "):
            assert heading[4:] in CHANGE_GROUPS, heading
            groups.append(heading[4:])
        else:
            assert groups == sorted(groups, key=CHANGE_GROUPS.index), groups
            assert len(groups) == len(set(groups)), groups
            groups = []


def test_fallback_version_is_the_newest_release() -> None:
    """A tree without git reports the newest release in CHANGELOG.md, not an older one."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    fallback = pyproject["tool"]["setuptools_scm"]["fallback_version"]
    newest = ".".join(str(part) for part in released_versions()[0])
    assert fallback == newest
