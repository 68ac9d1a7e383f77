"""What ships beside the agent for Kubernetes: one version, CSI volumes, the role's trust.

The image tag and wheel names that packaging/ and the docs tell people to build
and pull are the project's own version. The rest of the Kubernetes manifests'
checks are in test_k8s_manifests.py, whose helpers these tests share.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# -- one version ---------------------------------------------------------------------------

# registry.example.com/prewarm:0.2.0 (an image of the agent, under any registry), and
# prewarm_agent-0.2.0-py3-none-any.whl; "<version>" placeholders are no claim of a version.
IMAGE_TAG = re.compile(r"/prewarm:([\w.+-]+|<[^>\s]+>)")
WHEEL_VERSION = re.compile(r"prewarm_agent-([\w.+]+|<[^>\s]+>)-py3")


def project_version() -> str:
    """pyproject's fallback_version: the newest release (tests/project/test_habits.py)."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    version: str = pyproject["tool"]["setuptools_scm"]["fallback_version"]
    return version


def version_references(text: str) -> list[str]:
    """The versions ``text`` names in image tags of the agent and in wheel file names."""
    found = IMAGE_TAG.findall(text) + WHEEL_VERSION.findall(text)
    return [version for version in found if not version.startswith("<")]


def versioned_files() -> list[Path]:
    """Everything in packaging/, the docs and the README: what people copy commands from."""
    packaging = (path for path in (REPO / "packaging").rglob("*") if path.is_file())
    return sorted([*packaging, *(REPO / "docs").rglob("*.md"), REPO / "README.md"])


def test_every_image_tag_and_wheel_name_is_the_projects_version() -> None:
    """Each registry.../prewarm:<tag> and prewarm_agent-<v>-py3 wheel name in packaging/, docs/
    and the README is pyproject's fallback_version, so a copied build command, image
    reference or pip install names the release the tree is."""
    version = project_version()
    stale = {
        f"{path.relative_to(REPO)}: {found}"
        for path in versioned_files()
        for found in version_references(path.read_text(errors="replace"))
        if found != version
    }
    assert not stale, f"not {version}:\n" + "\n".join(sorted(stale))
    # The manifests do name it: a scan that found nothing would pass vacuously.
    assert version_references((REPO / "packaging" / "k8s" / "daemonset.yaml").read_text())


def test_the_version_scan_finds_tags_and_wheel_names_and_skips_placeholders() -> None:
    """The scan reads the tag of an agent image under any registry and the version of a wheel
    name, leaves other images and <version> placeholders alone, and so would catch a stale one."""
    text = (
        "image: registry.example.com/prewarm:0.1.0\n"
        "docker build -t REGISTRY/prewarm:0.1.1 .\n"
        "image: registry.example.com/vllm-openai-prewarm:latest\n"
        "COPY dist/prewarm_agent-0.1.2-py3-none-any.whl /tmp/\n"
        "pip install 'prewarm_agent-<version>-py3-none-any.whl[cli]'\n"
        "image: registry.example.com/prewarm:<tag>\n"
    )
    assert version_references(text) == ["0.1.0", "0.1.1", "0.1.2"]
