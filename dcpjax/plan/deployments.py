"""The example deployments dcpjax ships (`configs/*.json`), found through the package.

In a checkout they are the repository's `configs/` folder (`dcpjax/configs` links to it, so an
editable install reads them in place); a wheel carries them as package data in `dcpjax/configs/`.
Either way the path does not depend on the working directory:

    from dcpjax.plan.deployments import config_path
    from dcpjax.plan.deployment import Deployment

    deployment = Deployment.from_file(config_path("deepseek-v3-tp8-dcp8"))
"""

from __future__ import annotations

import pathlib

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"  # dcpjax/configs


def configs_dir() -> pathlib.Path:
    """The folder of the shipped deployment JSON files."""
    if not CONFIGS.is_dir():  # e.g. a checkout where git did not make the symlink (Windows)
        raise FileNotFoundError(f"dcpjax's deployment configs are missing: no folder {CONFIGS} — reinstall dcpjax "
                                "from a wheel, or use the repository's configs/ folder")
    return CONFIGS


def config_names() -> list[str]:
    """The shipped deployments' names: 'deepseek-v3-tp8-dcp8', ..."""
    return sorted(path.stem for path in configs_dir().glob("*.json"))


def config_path(name: str) -> pathlib.Path:
    """A shipped deployment's JSON file, by name ('deepseek-v3-tp8-dcp8') or file name."""
    path = configs_dir() / (name if name.endswith(".json") else f"{name}.json")
    if not path.is_file():
        raise ValueError(f"no shipped deployment {name!r}: the shipped ones are {', '.join(config_names())}")
    return path
