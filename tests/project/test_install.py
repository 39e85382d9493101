"""An install without CMake or a C++ compiler succeeds and runs attention on the pure-MLX reference: the sdist (which
carries everything the kernel's build needs) installed as a wheel and as an editable install, in a virtual
environment whose PATH has no compiler (the packages it needs come from this interpreter's site-packages: no
network)."""
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("sh", "bash", "env", "uname", "cat", "ls", "rm", "mkdir", "cp", "mv", "ln", "grep", "sed", "tar", "gzip",
         "dirname", "basename", "readlink", "id", "chmod", "touch", "head", "tail", "sort", "tr", "cut", "wc", "git")
COMPILERS = ("cmake", "c++", "g++", "gcc", "cc", "clang", "clang++")


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    out, tree = tmp_path_factory.mktemp("sdist"), tmp_path_factory.mktemp("tree")
    # from the files git knows (as a fresh clone has them): no egg-info of earlier builds lists files for it
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\n")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(out)], cwd=tree, check=True,
                   capture_output=True)
    (archive,) = out.glob("veloxquant_mlx-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    sources = [f"veloxquant_mlx/attention/csrc/{n}.cpp" for n in ("coded_attention", "affine_encode", "gather_rows")]
    needed = ["veloxquant_mlx/attention/csrc/CMakeLists.txt", "veloxquant_mlx/attention/build_kernel.py",
              "veloxquant_mlx/attention/_sources.py", "setup.py", "pyproject.toml"] + sources
    missing = [n for n in needed if not any(x.endswith(n) for x in names)]
    assert not missing, f"the sdist lacks {missing}"
    return archive


# What the install under test needs from the environment running the tests (scripts/setup.sh installs them).
BUILD_TOOLS = {"setuptools": (68,), "wheel": (0,), "pip": (0,)}


def _runner_site_dirs():
    """The site-packages of the interpreter running the tests, whatever it is (system, venv, conda), in order."""
    dirs = list(site.getsitepackages()) + [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
    return list(dict.fromkeys(d for d in dirs if os.path.isdir(d)))


@pytest.fixture(scope="module")
def no_compiler_env(tmp_path_factory):
    """(python of a fresh venv seeing this interpreter's packages, environment whose PATH has no compiler).

    ``venv --system-site-packages`` would show the *base* interpreter's packages: run from a virtual environment,
    the new venv then misses the runner's setuptools, wheel and MLX and gets its own bundled setuptools (65.5 on
    Python 3.11: no ``bdist_wheel``). So the venv is made bare and a ``.pth`` file adds the runner's own site
    directories after its own, which also processes their ``.pth`` files as ``--system-site-packages`` would."""
    base = tmp_path_factory.mktemp("nocompiler")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    inner = subprocess.run([str(venv / "bin" / "python"), "-c", "import site; print(site.getsitepackages()[0])"],
                           check=True, capture_output=True, text=True).stdout.strip()
    lines = [f"import site; site.addsitedir({d!r})" for d in _runner_site_dirs()]
    (Path(inner) / "_veloxquant_test_runner_site.pth").write_text("\n".join(lines) + "\n")
    bin_dir = base / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    env = dict(os.environ, PATH=f"{venv / 'bin'}{os.pathsep}{bin_dir}", PIP_NO_INDEX="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    for c in COMPILERS:
        assert shutil.which(c, path=env["PATH"]) is None, f"{c} is still on the test's PATH"
    python = venv / "bin" / "python"
    _check_build_tools(python, env)
    return python, env


def _check_build_tools(python, env):
    """Fails, naming what is missing, when the venv cannot see the build tools the offline install needs."""
    code = ("import importlib.metadata as m, sys\n"
            f"for name, least in {BUILD_TOOLS!r}.items():\n"
            "    try: v = m.version(name)\n"
            "    except m.PackageNotFoundError: print(name, 'missing'); continue\n"
            "    if tuple(int(x) for x in v.split('.')[:len(least)]) < least: print(name, v, 'too old')\n"
            # the command `pip install` of an sdist runs (setuptools' own from 70.1, else the wheel package's)
            "from setuptools.dist import Distribution; Distribution().get_command_class('bdist_wheel')\n")
    r = subprocess.run([str(python), "-c", code], env=env, capture_output=True, text=True)
    problems = (r.stdout + r.stderr).strip()
    assert r.returncode == 0 and not problems, (
        f"the no-compiler venv sees the runner's packages ({_runner_site_dirs()}) but cannot build a wheel "
        f"offline: {problems[-1500:]}. Install the build tools into the environment running the tests "
        "(bash scripts/setup.sh --test does: setuptools>=68 and wheel).")


def _install_and_run(python, env, target, *flags, cwd):
    r = subprocess.run([str(python), "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--force-reinstall",
                        *flags, str(target)], env=env, cwd=cwd, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    code = ("import veloxquant_mlx, veloxquant_mlx.attention.kernel as k; import mlx.core as mx; "
            "from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache as C; "
            "c = C(fetch_placeholders=False); x = mx.ones((1, 2, 70, 64)); c.update_and_fetch(x, x); "
            "print(veloxquant_mlx.__file__); print(k.status()[0]); "
            "from veloxquant_mlx.apps.eval.tiny_configs import CONFIGS; print(len(CONFIGS))")  # (package data)
    r = subprocess.run([str(python), "-c", code], env=env, cwd=cwd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    where, kernel, configs = r.stdout.split()
    assert int(configs) > 100, "the tiny configurations (package data) were not installed"
    return where, kernel


def test_wheel_and_editable_install_without_a_compiler(sdist, no_compiler_env, tmp_path):
    python, env = no_compiler_env
    where, kernel = _install_and_run(python, env, sdist, cwd=tmp_path)
    assert str(Path(python).parent.parent) in where and kernel == "False"  # installed there, on the reference
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "src")
    (src,) = (tmp_path / "src").iterdir()
    where, kernel = _install_and_run(python, env, src, "-e", cwd=tmp_path)
    assert where.startswith(str(src)) and kernel == "False"
    assert not list(src.glob("veloxquant_mlx/attention/_coded_attention*")), "a library that was never built"
