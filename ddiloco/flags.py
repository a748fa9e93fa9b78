"""argparse with environment-variable defaults, for the services' `config.py` modules.

Every option can be given as a flag or as an environment variable (12-factor, so compose files
and Kubernetes manifests configure services without editing commands). The environment is passed
in explicitly: only a service's `__main__` reads `os.environ`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any


class EnvArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose options may also come from named environment variables.

    Precedence: command-line flag > environment variable > default. `--help` names the variable
    and shows the default for every option.
    """

    def __init__(self, *args: Any, environ: Mapping[str, str], **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)
        self._environ = environ
        # Every service: the build it runs (package metadata and the commit it was built from).
        from ddiloco import build_info

        self.add_argument("--version", action="version", version=build_info.describe(self.prog))

    def add_env_argument(self, flag: str, *, env: str, type: Callable[[str], Any] = str, **kwargs: Any):
        """Adds `flag`, defaulting to the value of `env` when it is set (parsed with `type`)."""
        # argparse %-formats help strings (for %(default)s); a literal % must be doubled.
        help_text = kwargs.pop("help", "").replace("%", "%%")
        kwargs["help"] = f"{help_text} [env: {env}]"
        if env in self._environ:
            raw = self._environ[env]
            try:
                kwargs["default"] = type(raw)
            except (TypeError, ValueError) as exc:
                self.error(f"environment variable {env}={raw!r} is not valid for {flag}: {exc}")
            kwargs.pop("required", None)
        return self.add_argument(flag, type=type, **kwargs)


def parse_bool(text: str) -> bool:
    """Parses 1/0, true/false, yes/no, on/off (case-insensitive)."""
    value = text.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"expected a boolean (true/false), got {text!r}")


def parse_dataclass(
    cls: type,
    *,
    prog: str,
    description: str,
    env_prefix: str,
    helps: Mapping[str, str],
    argv: list[str] | tuple[str, ...],
    environ: Mapping[str, str],
):
    """Parses flags into a frozen config dataclass: one `--field-name` and one env var per field.

    Field types must be bool, int, float or str (as annotations under `from __future__ import
    annotations`). A ValueError from the dataclass's own validation becomes a usage error.
    """
    import dataclasses

    parser = EnvArgumentParser(prog=prog, description=description, environ=environ)
    for field in dataclasses.fields(cls):
        kind = {"bool": parse_bool, "int": int, "float": float}.get(str(field.type), str)
        # Booleans work as plain switches (`--once`) and with a value (`--json-logs false`).
        extra = {"nargs": "?", "const": True} if kind is parse_bool else {}
        parser.add_env_argument(
            "--" + field.name.replace("_", "-"),
            env=env_prefix + field.name.upper(),
            type=kind,
            default=field.default,
            dest=field.name,
            help=helps[field.name],
            **extra,
        )
    args = parser.parse_args(list(argv))
    try:
        return cls(**vars(args))
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
