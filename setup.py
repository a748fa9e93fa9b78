"""The packages of the wheel: everything under ddiloco/, plus the repository's services/ folder as
`ddiloco.services` (the rest of the configuration is in pyproject.toml).

Why here and not in pyproject.toml: setuptools' `packages.find` names a package after its folder,
so it would ship services/ as a top-level `services` package, which collides with any other
distribution's (or the user's own) `services` in site-packages. pyproject.toml cannot rename what
`find` finds, and a hand-written package list would silently drop a new subpackage; this
finds both trees and maps the second under `ddiloco`.
"""

from setuptools import find_packages, setup

SERVICES = ["ddiloco." + name for name in find_packages(include=["services", "services.*"])]

setup(
    packages=find_packages(include=["ddiloco", "ddiloco.*"]) + SERVICES,
    package_dir={"ddiloco.services": "services"},
)
