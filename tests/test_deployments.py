"""The shipped deployments are found through the package, wherever the working directory is."""

import pathlib
import subprocess
import sys
import tomllib

import pytest

from dcpjax.plan import deployments

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_package_finds_the_repository_configs():
    shipped = sorted(path.name for path in (ROOT / "configs").glob("*.json"))
    assert shipped and [f"{name}.json" for name in deployments.config_names()] == shipped
    for name in shipped:
        assert deployments.config_path(name).samefile(ROOT / "configs" / name)
        assert deployments.config_path(name.removesuffix(".json")).samefile(ROOT / "configs" / name)


def test_a_wheel_carries_them():
    """package-data ships what configs_dir() reads: the files under dcpjax/configs (and the CPU kernel's
    source, which `quantization.cpu_kernel` compiles on first use)."""
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globbed = {path.relative_to(ROOT / "dcpjax").as_posix() for pattern in package_data["dcpjax"]
               for path in (ROOT / "dcpjax").glob(pattern)}
    kernel = {"quantization/cpu_kernel/quantized_matmul.cc"}
    assert globbed == {f"configs/{name}.json" for name in deployments.config_names()} | kernel


def test_an_unknown_name_lists_the_shipped_ones():
    with pytest.raises(ValueError, match="deepseek-v3-tp8-dcp8") as err:
        deployments.config_path("no-such-deployment")
    assert "no-such-deployment" in str(err.value)


def test_found_from_another_working_directory(tmp_path):
    code = "from dcpjax.plan.deployments import config_path; print(config_path('deepseek-v3-tp8-dcp8').read_text()[:1])"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "{"
