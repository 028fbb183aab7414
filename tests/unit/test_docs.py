"""The documentation is true: the site builds, and the code in it runs.

* ``mkdocs build --strict`` (offline, into a temporary directory): a broken link or anchor, a
  missing ``--8<--`` snippet, or a config key without a description (the configuration
  reference page is generated from the schema at build time) fails it.
* Every ```toml block of README.md and docs/ that is a whole config passes ``grpo config check``
  (in-process, through the CLI's own entry point). Every ```python block compiles and its
  imports run; it runs whole unless marked compile-only.
* The docs' configs are checked as for a machine that can reach the hub (``HF_HUB_OFFLINE`` unset
  for the check: a hub dataset is then a warning that it is fetched at run time, not an error).
* docs/from-trl.md's generated table of defaults that differ lists exactly the fields whose defaults differ
  (recomputed here another way), and the few that differ only in some configs are said after it.

Conventions, written as an HTML comment on the line before a block (invisible on the site):

    <!-- fragment -->           part of a config, or another file's TOML (a pyproject.toml):
                                parsed as TOML, not checked as a config
    <!-- config-dir: PATH -->   check the config as a file in PATH (relative to the repository),
                                so its relative dataset paths and reward modules resolve there;
                                options after PATH go to the check (``--num-processes 8``), except
                                ``installed=PACKAGE``: that package folder (relative to the
                                repository) is pip-installed into a temporary folder and visible to
                                the check, as the page tells the reader to install it
    <!-- compile-only: why -->  a Python block that is not run (it trains, or is an excerpt)
    <!-- fmt: off -->           ruff leaves the block as written (a Python block that is one
                                ``--8<--`` line, which ruff would reformat); checked as unmarked

A line ``--8<-- "path"`` inside a block is replaced by that file, as the site shows it.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import HUB_OFFLINE, REPO
from pip_target import install_into_target
from plugin_set import only_plugins_from

ROOT = REPO
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
MARK = re.compile(r"^\s*<!--\s*([\w-]+)\s*:?\s*(.*?)\s*-->\s*$")
SNIPPET = re.compile(r'^\s*--8<--\s+"([^"]+)"\s*$')


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    mark: str | None  # fragment, config-dir, compile-only, ...
    mark_value: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _expand(text: str) -> str:
    lines = []
    for line in text.splitlines(keepends=True):
        found = SNIPPET.match(line)
        lines.append((ROOT / found.group(1)).read_text(encoding="utf-8") if found else line)
    return "".join(lines)


def blocks(lang: str) -> list[Block]:
    out = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines(keepends=True)
        i = 0
        while i < len(lines):
            opening = FENCE.match(lines[i])
            if not opening:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            if opening.group(2) == lang:
                before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
                mark = MARK.match(before)
                text = _expand("".join(line[len(opening.group(1)) :] for line in lines[i + 1 : end]))
                out.append(
                    Block(page, i + 1, lang, text, mark.group(1) if mark else None, mark.group(2) if mark else "")
                )
            i = end + 1
    return out


TOML = blocks("toml")
CONFIGS = [b for b in TOML if b.mark != "fragment"]
PYTHON = blocks("python")


def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reference = (tmp_path / "configuration" / "index.html").read_text(encoding="utf-8")
    assert "trl.reward_funcs" in reference and "vllm.gpu_memory_utilization" in reference


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_every_config_key_has_a_description() -> None:
    reference = _script("config_reference")
    assert reference.undocumented() == [], "add Field(description=...) in grpo_core/config/schema.py"
    page = reference.render()
    assert "| `trl.max_completion_length` | `int | null` | `null` → `256` |" in page  # filled-in defaults shown


def test_the_blocks_are_found_and_marked() -> None:
    assert len(CONFIGS) >= 5 and len(PYTHON) >= 5, (len(CONFIGS), len(PYTHON))
    for block in TOML + PYTHON:
        assert block.mark in (None, "fragment", "config-dir", "compile-only", "fmt"), f"{block.where}: unknown mark"
        if block.mark == "config-dir":
            folder = block.mark_value.split()[0]
            assert (ROOT / folder).is_dir(), f"{block.where}: no folder {folder}"
    for block in TOML:
        tomllib.loads(block.text)  # a fragment is TOML too


INSTALLED = "installed="


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``installed("examples/my-rewards")``: that package, pip-installed
    (offline, no dependencies) into a temporary site folder once per module;
    returns the site folder."""
    sites: dict[str, Path] = {}

    def install(package: str) -> Path:
        if package not in sites:
            sites[package] = install_into_target(ROOT / package, tmp_path_factory.mktemp("installed"))
        return sites[package]

    return install


def check_block(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sites: list[Path]) -> int:
    """``grpo config check`` on ``block`` in process, as its mark says, seeing
    grpo's own plugins and those installed in ``sites`` (nothing else the
    venv may hold): its exit code."""
    from grpo_core.interface.cli import main

    options: list[str] = []
    if block.mark == "config-dir":
        folder, *options = block.mark_value.split()
        options = [o for o in options if not o.startswith(INSTALLED)]
        shutil.copytree(ROOT / folder, tmp_path, dirs_exist_ok=True)
    config = tmp_path / "docs-config.toml"
    config.write_text(block.text, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [*map(str, sites), *sys.path])  # the check puts the config's folder on it
    for variable in HUB_OFFLINE:  # a reader's machine reaches the hub
        monkeypatch.delenv(variable, raising=False)
    for module in tmp_path.glob("*.py"):  # a same-named module another test imported would answer for this one's
        monkeypatch.delitem(sys.modules, module.stem, raising=False)
    try:
        with only_plugins_from(*sites):
            return main(["config", "check", str(config), *options])
    finally:  # the config's own modules (rewards, tools), and the installed packages', must not answer for the next
        for name, module in list(sys.modules.items()):
            where = str(getattr(module, "__file__", None) or "")
            if where.startswith(str(tmp_path)) or any(where.startswith(str(site)) for site in sites):
                del sys.modules[name]


def packages(block: Block) -> list[str]:
    return [o[len(INSTALLED) :] for o in block.mark_value.split()[1:] if o.startswith(INSTALLED)]


@pytest.mark.parametrize("block", CONFIGS, ids=[b.where for b in CONFIGS])
def test_each_config_in_the_docs_passes_config_check(
    block: Block,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    installed: Callable[[str], Path],
) -> None:
    code = check_block(block, tmp_path, monkeypatch, [installed(p) for p in packages(block)])
    output = capsys.readouterr()
    assert code == 0, f"{block.where}: grpo config check exited {code}\n{output.out[-2000:]}{output.err[-2000:]}"


def test_the_reward_package_goal_is_checked_with_and_without_the_package(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    installed: Callable[[str], Path],
) -> None:
    """The issue's pip-installable reward package: the page's config is a
    checked config (not a fragment) that names the package's reward; the
    check passes with the package installed (the parametrized test above)
    and, without it, fails naming the reward. The installed reward works."""
    page = ROOT / "docs" / "plugins.md"
    [block] = [b for b in CONFIGS if b.page == page and packages(b) == ["examples/my-rewards"]]
    assert "brevity" in tomllib.loads(block.text)["trl"]["reward_funcs"]
    assert "docs/plugins.md#a-pip-installable-reward-package" in (ROOT / "README.md").read_text(encoding="utf-8")
    code = check_block(block, tmp_path, monkeypatch, [])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "trl.reward_funcs[1] = 'brevity': no installed package registers a reward function of that name" in err
    site = installed("examples/my-rewards")
    assert {p.name for p in site.glob("my_rewards-*.dist-info")}, "pip installed no distribution"
    monkeypatch.syspath_prepend(str(site))
    try:
        from my_rewards.rewards import brevity

        assert brevity([[{"role": "assistant", "content": "short"}]], max_words=3) == [1.0]
        assert brevity(["one two three four five six"], max_words=3) == [0.0]
        assert brevity(["one two three four"], max_words=3) == pytest.approx([2 - 4 / 3])
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] == "my_rewards"]:
            del sys.modules[name]


@pytest.mark.parametrize("block", PYTHON, ids=[b.where for b in PYTHON])
def test_each_python_block_compiles_imports_and_runs(
    block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code = compile(block.text, block.where, "exec")
    monkeypatch.chdir(tmp_path)
    if block.mark == "compile-only":
        tree = ast.parse(block.text)
        imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        code = compile(ast.Module(body=imports, type_ignores=[]), block.where, "exec")
    exec(code, {"__name__": "docs_block"})


# TRL defaults that equal grpo's once grpo fills in its value, or that only look different.
SAME_DEFAULT = {
    "use_vllm": "the comparison turns use_vllm on for grpo, to read the server-mode defaults",
    "epsilon_high": "unset in both means epsilon",
    "num_completions_to_print": "TRL's None and grpo's 0 both print every completion with log_completions",
    "vllm_importance_sampling_cap": "deprecated in TRL for vllm_importance_sampling_clip_max (3.0), grpo's cap (3.0)",
    "adam_beta1": "grpo's unset is 0.9",
    "adam_beta2": "grpo's unset is 0.999",
    "adam_epsilon": "grpo's unset is 1e-8",
    "report_to": "TRL's 'none' and grpo's unset: no tracker (grpo's metrics.jsonl is always written)",
}


def test_the_trl_defaults_table_lists_every_default_that_differs() -> None:
    from trl import GRPOConfig as TrlConfig

    from grpo_core.config.loader import validate

    def trl_default(name: str) -> object:
        field = next(f for f in dataclasses.fields(TrlConfig) if f.name == name)
        return field.default_factory() if field.default is dataclasses.MISSING else field.default  # type: ignore[misc]

    def grpo_value(cfg: object, key: str) -> object:
        for part in key.split("."):
            cfg = getattr(cfg, part)
        value = cfg
        return str(value) if isinstance(value, Path) else value

    plain, with_vllm = validate({"base_model": "m"}), validate({"base_model": "m", "trl": {"use_vllm": True}})
    names = {f.name for f in dataclasses.fields(TrlConfig)}
    differ = set()
    for name, key, _ in _script("trl_mapping").rows():
        if key == "—" or name not in names or name in SAME_DEFAULT:
            continue
        theirs = trl_default(name)
        if any(grpo_value(cfg, key.strip("`")) != theirs for cfg in (plain, with_vllm)):
            differ.add(name)
    page = (ROOT / "docs" / "from-trl.md").read_text(encoding="utf-8")
    section = page.split("<!-- trl-differences:start -->", 1)[1].split("<!-- trl-differences:end -->", 1)[0]
    rows = {m.group(1) for m in re.finditer(r"^\| `(\w+)` = ", section, re.MULTILINE)}
    said = {name for name in differ if re.search(rf"`(\w+\.)?{name}`", section)}  # a row, or a sentence after
    assert differ - said == set(), f"scripts/trl_mapping.py: say why for each of {sorted(differ - said)}"
    assert rows - differ == set(), f"docs/from-trl.md: the defaults now agree for {sorted(rows - differ)}"
    assert not (ROOT / "docs" / "trl-differences.md").exists()  # one table of them, generated into from-trl.md
