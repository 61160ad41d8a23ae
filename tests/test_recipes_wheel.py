"""The recipes ship in the wheel (Note [Shipped recipes] in lightning_seqpar/cli/seqpar.py): `seqpar recipes` lists them,
`seqpar recipes cp` copies one out, `--config NAME` reads one by name; and a wheel built from this tree, installed
into a fresh virtual environment, has them and runs them from a folder outside the repository."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from lightning_seqpar.cli import seqpar as cli

ROOT = Path(__file__).resolve().parent.parent


def test_every_recipe_has_a_one_line_summary_and_the_repository_path_reaches_the_shipped_files():
    names = cli.recipe_names()
    assert {"quickstart", "quickstart_gpu", "llama3_8b", "slurm/llama3_8b_multinode"} <= set(names)
    for name in names:
        summary = cli.recipe_summary(cli.RECIPES_DIR / f"{name}.yaml")
        assert summary.endswith(".") and len(summary) <= 120, (name, summary)
    # the repository's recipes/ (what the docs and tests name) is the package's folder
    assert (ROOT / "recipes" / "quickstart.yaml").resolve() == (cli.RECIPES_DIR / "quickstart.yaml").resolve()


def test_config_names_a_shipped_recipe_and_a_file_that_exists_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shipped = str(cli.RECIPES_DIR / "quickstart.yaml")
    for value in ("quickstart", "quickstart.yaml", "recipes/quickstart.yaml"):
        assert cli.resolve_recipe_args(["fit", "--config", value, "--trainer.max_steps", "2"]) == [
            "fit", "--config", shipped, "--trainer.max_steps", "2"]
    assert cli.resolve_recipe_args(["fit", f"--config=quickstart"]) == ["fit", f"--config={shipped}"]
    assert cli.resolve_recipe_args(["fit", "-c", "slurm/llama3_8b_multinode"])[-1].endswith("llama3_8b_multinode.yaml")
    (tmp_path / "quickstart").write_text("seed_everything: 1\n")  # a file of that name: the user's, not ours
    assert cli.resolve_recipe_args(["fit", "--config", "quickstart"]) == ["fit", "--config", "quickstart"]
    inline = "trainer: {max_steps: 1}"  # jsonargparse's inline YAML passes through
    assert cli.resolve_recipe_args(["fit", "--config", inline]) == ["fit", "--config", inline]
    with pytest.raises(ValueError, match="did you mean quickstart"):
        cli.resolve_recipe_args(["fit", "--config", "quickstrat"])


def test_seqpar_recipes_lists_them_and_cp_copies_one_out(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cli.main(["recipes"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(cli.recipe_names())
    assert any(line.startswith("quickstart ") and "CPU" in line for line in lines), lines
    cli.main(["recipes", "cp", "quickstart"])
    assert (tmp_path / "quickstart.yaml").read_text() == (cli.RECIPES_DIR / "quickstart.yaml").read_text()
    with pytest.raises(SystemExit):  # never overwrites without --force
        cli.main(["recipes", "cp", "quickstart"])
    (tmp_path / "mine").mkdir()
    cli.main(["recipes", "cp", "tnl_tiny", "mine"])
    assert (tmp_path / "mine" / "tnl_tiny.yaml").is_file()
    with pytest.raises(SystemExit):
        cli.main(["recipes", "cp", "no_such_recipe"])


def _run(cmd: list, cwd: Path, env: dict) -> str:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{cmd}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_wheel_ships_the_recipes_and_runs_one_by_name_outside_the_repository(tmp_path):
    """Build the wheel from a copy of this tree, install it (not editable) into a fresh venv that sees this
    environment's torch / lightning, and from a folder outside the repository: `seqpar recipes`, `seqpar recipes cp`
    and `seqpar fit --config quickstart --print_config` (the full CPU quickstart by name takes minutes: a dry run)."""
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "lightning_seqpar", src / "lightning_seqpar",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", ".", "-w", tmp_path / "dist"],
         src, env)
    (wheel,) = (tmp_path / "dist").glob("lightning_seqpar-*.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("lightning_seqpar/recipes/")}
    expected = {f"lightning_seqpar/recipes/{p.relative_to(ROOT / 'recipes').as_posix()}"
                for p in (ROOT / "recipes").rglob("*") if p.is_file()}
    assert shipped == expected and any(n.endswith("quickstart.yaml") for n in shipped)

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    bindir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / "python"
    # the system's pip, run by the venv's python, installs into the venv
    _run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], tmp_path, env)
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {**env, "PATH": f"{bindir}{os.pathsep}{env.get('PATH', '')}"}
    # one interpreter (each start imports torch and Lightning: 8 CPU-s) for the package's location, `seqpar recipes`,
    # `seqpar recipes cp` and then the installed console script itself (the file pip wrote, run as its shebang's
    # interpreter runs it: `seqpar fit --config quickstart --print_config`, which prints and exits)
    script = bindir / "seqpar"
    assert script.read_text().startswith(f"#!{python}"), script.read_text()  # the venv's interpreter runs it
    out = _run([python, "-c", "import runpy, sys; from lightning_seqpar.cli import seqpar as c; print(c.__file__); "
                "print(c.RECIPES_DIR); c.main(['recipes']); c.main(['recipes', 'cp', 'quickstart', 'mine.yaml']); "
                "print('--- print_config', flush=True); "
                f"sys.argv = [{str(script)!r}, 'fit', '--config', 'quickstart', '--print_config']; "
                f"runpy.run_path({str(script)!r}, run_name='__main__')"], away, env)
    listing, _, config = out.partition("--- print_config\n")
    where = "\n".join(listing.splitlines()[:2])
    assert str(env_dir) in where and str(ROOT) not in where, where  # the wheel's package, not this tree's
    assert "quickstart " in listing and "quickstart_gpu" in listing, listing
    assert (away / "mine.yaml").read_text() == (ROOT / "recipes" / "quickstart.yaml").read_text()
    assert "lightning_seqpar.SequenceParallelStrategy" in config and "sequence_parallel_size: 2" in config, config
