"""The installed distribution is one package, ``kiln``: every folder of Kiln's code is one of its subpackages, and the
bundled configs, tiny model and calibration data travel with it; the sdist also carries the tests, docs and Makefile."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

from kiln.runtime.kiln_python import kiln_module_command
from tests.subprocess_env import REPO

LAYERS = ("runtime", "engines", "calibration", "pipeline")
BUNDLED = ("kiln/configs/tiny-llama-fp8.yaml", "kiln/configs/models/llama3-8b.json",
           "kiln/models/tiny-llama/model.safetensors", "kiln/models/tiny-llama/tokenizer.json",
           "kiln/data/tiny/calibration.jsonl", "kiln/data/tiny/heldout.jsonl",
           "kiln/engines/trtllm/contract/trtllm-1.2.1.json", "kiln/py.typed")
CHECKOUT_ONLY = ("tests", "docs", "examples", "tools", "Makefile")  # in the sdist, never in the wheel


def code_modules() -> set[str]:
    """The checkout's Python files of Kiln's code, as paths inside the installed ``kiln`` package."""
    return {f"kiln/{path.relative_to(REPO).as_posix()}" for layer in LAYERS for path in (REPO / layer).rglob("*.py")
            if "__pycache__" not in path.parts}


def test_every_code_folder_is_a_listed_subpackage_of_kiln():
    """Every folder that holds code has an ``__init__.py`` (a folder without one was left out of the wheel) and is
    listed in pyproject.toml."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    modules = code_modules()
    code_folders = {module.rsplit("/", 1)[0] for module in modules}
    assert not sorted(folder for folder in code_folders if f"{folder}/__init__.py" not in modules)
    folders = {"kiln"} | {folder.replace("/", ".") for folder in code_folders}
    code_packages = {name for name in setuptools["packages"] if name.split(".")[:2] != ["kiln", "configs"]
                     and name not in ("kiln.models", "kiln.data.tiny")}
    assert setuptools["package-dir"] == {"kiln": "."}
    assert code_packages == folders


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A copy of the checkout's sources, so a build leaves nothing in the checkout."""
    pytest.importorskip("setuptools")
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "MANIFEST.in", "README.md", "__init__.py", "__main__.py", "py.typed", *LAYERS,
                 "configs", "models", "data", *CHECKOUT_ONLY):
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, source / name)
    return source


@pytest.fixture(scope="module")
def wheel(source, tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(source)], check=True, capture_output=True)
    return zipfile.ZipFile(next(out.glob("kiln-*.whl")))


def test_the_wheel_installs_kiln_and_no_other_top_level_name(wheel):
    names = wheel.namelist()
    dist_info = next(n for n in names if ".dist-info/" in n).split("/")[0]
    assert {name.split("/")[0] for name in names} == {"kiln", dist_info}
    assert not [name for name in names if name.split("/")[1] in CHECKOUT_ONLY]
    assert "kiln/runtime/llm.py" in names and "kiln/__main__.py" in names
    entry_points = wheel.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "kiln = kiln.pipeline.entry:main" in entry_points


def test_the_kiln_command_without_its_dependencies_says_in_one_line_what_to_install():  # the runtime alone
    code = "import sys; sys.modules['typer'] = None; sys.argv = ['kiln', *sys.argv[1:]]; import kiln.__main__"
    _, env = kiln_module_command("kiln")
    found = subprocess.run([sys.executable, "-c", code, "build", "x.yaml"], env=env, capture_output=True, text=True,
                           cwd="/")
    assert found.returncode == 2 and found.stderr == ("error: the kiln command needs Kiln's dependencies (typer is "
                                                      "missing): install Kiln with them (its wheel or checkout "
                                                      "without --no-deps); the runtime installed alone has no "
                                                      "command line\n")
    found = subprocess.run([sys.executable, "-c", code, "--version"], env=env, capture_output=True, text=True,
                           cwd="/")  # what an operator checks first answers still
    assert found.returncode == 0 and found.stdout.startswith("kiln "), found.stderr[-1000:]


def test_the_wheel_carries_every_module_of_the_code(wheel):
    assert not sorted(code_modules() - set(wheel.namelist()))


def test_the_wheel_carries_the_bundled_configs_model_and_calibration_data(wheel):
    assert set(BUNDLED) <= set(wheel.namelist())


@pytest.fixture(scope="module")
def sdist(source, tmp_path_factory) -> set[str]:
    """The sdist's file names, relative to its top folder."""
    out = tmp_path_factory.mktemp("sdist")
    build = "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])"
    subprocess.run([sys.executable, "-c", build, str(out)], cwd=source, check=True, capture_output=True)
    with tarfile.open(next(out.glob("kiln-*.tar.gz"))) as tar:
        return {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}


def test_the_sdist_carries_the_tests_with_their_helpers_the_docs_and_the_makefile(sdist):
    assert {"tests/conftest.py", "tests/subprocess_env.py", "tests/model_factories.py",
            "tests/calibration_factories.py", "tests/fakes/trtllm-build", "docs/embedding.md",
            "examples/embedded_service.py", "Makefile"} <= sdist


@pytest.mark.parametrize("missing", ["fastapi", "uvicorn"])
def test_importing_the_server_without_the_serve_extra_names_the_extra_to_install(missing):
    code = (f"import sys; sys.modules[{missing!r}] = None\n"  # as if it were not installed
            "try:\n    import kiln.runtime.server\nexcept ModuleNotFoundError as exc:\n    print(exc.name, exc)")
    _, env = kiln_module_command("kiln")
    found = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd="/")
    assert found.stdout.strip() == (f"{missing} kiln.runtime.server needs the serve extra ({missing} is missing): "
                                    "pip install '.[serve]' in Kiln's checkout, or "
                                    "'path/to/kiln-VERSION-py3-none-any.whl[serve]'"), found.stderr[-1000:]


def test_kiln_processes_never_import_a_kiln_folder_of_the_working_directory(tmp_path):
    (tmp_path / "kiln").mkdir()  # another checkout beside the caller: `git clone .../kiln && pip install ./kiln`
    (tmp_path / "kiln" / "__init__.py").write_text("raise SystemExit('the kiln of the working directory')")
    argv, env = kiln_module_command("kiln.runtime.version")
    found = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert found.returncode == 0, found.stderr[-1000:]


def test_kiln_processes_import_as_this_process_does_a_kiln_reached_through_a_symlink_included(tmp_path):
    (tmp_path / "pp").mkdir()
    (tmp_path / "pp" / "kiln").symlink_to(REPO, target_is_directory=True)  # a checkout reached as pp/kiln -> repo
    (tmp_path / "app").mkdir()  # the caller's script folder: its modules, one named as the standard library's
    (tmp_path / "app" / "which_kiln.py").write_text("import kiln; print(kiln.__file__)")
    (tmp_path / "app" / "types.py").write_text("raise SystemExit('the app types.py shadowed the standard library')")
    code = ("import sys; sys.path[:0] = sys.argv[1:3]; import kiln; "
            "from kiln.runtime.kiln_python import kiln_module_command; import subprocess; "
            "argv, env = kiln_module_command('which_kiln'); "
            "done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd='/'); "
            "print(done.stdout.strip(), done.stderr[-500:])")
    found = subprocess.run([sys.executable, "-c", code, str(tmp_path / "pp"), str(tmp_path / "app")],
                           capture_output=True, text=True, cwd="/")
    assert found.stdout.strip() == str(tmp_path / "pp" / "kiln" / "__init__.py"), (found.stdout, found.stderr[-1000:])
