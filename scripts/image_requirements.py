"""Prints the requirements the container image installs, one a line: pyproject.toml's dependencies
plus its `server` extra, whose `ddiloco[a,b]` entries are expanded into those extras' requirements.

One definition for the two places that need the list before the project can be installed: the
Dockerfile's dependency layer and scripts/docker_env.sh's offline wheels.

    python3 scripts/image_requirements.py pyproject.toml [--build-system]

--build-system: also the build-system requirements (setuptools, to build the project offline).
"""

from __future__ import annotations

import re
import sys
import tomllib

EXTRA = "server"


def requirements(pyproject: dict, extra: str = EXTRA) -> list[str]:
    project = pyproject["project"]
    extras = project.get("optional-dependencies", {})
    out = list(project["dependencies"])
    pending, seen = [extra], set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        for requirement in extras[name]:
            own = re.fullmatch(rf"{re.escape(project['name'])}\[([\w,\s-]+)\]", requirement.strip())
            if own:  # a self-reference: the named extras' requirements instead
                pending += [n.strip() for n in own.group(1).split(",")]
            else:
                out.append(requirement)
    return out


def main(argv: list[str]) -> int:
    with open(argv[0], "rb") as f:
        pyproject = tomllib.load(f)
    reqs = requirements(pyproject)
    if "--build-system" in argv[1:]:
        reqs += pyproject["build-system"]["requires"]
    print("\n".join(reqs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
