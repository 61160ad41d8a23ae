"""The `seqpar` console script: subcommands, an in-process run, and a 2-process run through Lightning's launcher."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_seqpar.cli.seqpar import SUBCOMMANDS, main

QUICKSTART = Path(__file__).parent.parent / "recipes" / "quickstart.yaml"


def _short_run(save_dir: Path, steps: int) -> list[str]:
    return [
        "--config", str(QUICKSTART),
        f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={steps}", "--trainer.limit_val_batches=1",
        "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={save_dir}",
        "--data.init_args.seq_len=32", "--data.init_args.batch_size=2", "--data.init_args.val_samples=2",
    ]


def _metrics(save_dir: Path) -> list[dict[str, str]]:
    (path,) = save_dir.glob("lightning_logs/version_*/metrics.csv")
    return list(csv.DictReader(path.open()))


def test_help_lists_the_subcommands(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["seqpar"])
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out
    assert "predict" not in out


def test_fit_in_process_one_device(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["seqpar"])
    main(["fit", *_short_run(tmp_path, 3), "--trainer.devices=1", "--trainer.strategy.init_args.sequence_parallel_size=1"])
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows if r.get("train/loss")] == ["0", "1", "2"]
    assert any(r.get("val/loss") for r in rows)
    assert (tmp_path / "lightning_logs" / "version_0" / "config.yaml").is_file()


@pytest.mark.timeout(300)
def test_console_script_two_processes(tmp_path):
    """`seqpar fit --config recipes/quickstart.yaml` (shortened): Lightning launches the second rank."""
    exe = shutil.which("seqpar")
    if exe is None:
        pytest.skip("the package is not installed (no `seqpar` console script on PATH)")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(key, None)
    result = subprocess.run([exe, "fit", *_short_run(tmp_path, 4)], env=env, capture_output=True, text=True,
                            timeout=280, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = _metrics(tmp_path)
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 4
    assert any(r.get("val/loss") for r in rows)


def test_validate_from_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["seqpar"])
    one_device = ["--trainer.devices=1", "--trainer.strategy.init_args.sequence_parallel_size=1"]
    main(["fit", *_short_run(tmp_path / "fit", 2), *one_device, "--trainer.enable_checkpointing=true"])
    (ckpt,) = (tmp_path / "fit").glob("lightning_logs/version_0/checkpoints/*.ckpt")
    assert ckpt.is_dir()  # save_distributed_checkpoint=True: a folder of shards
    main(["validate", *_short_run(tmp_path / "val", 2), *one_device, f"--ckpt_path={ckpt}"])
    rows = _metrics(tmp_path / "val")
    assert any(r.get("val/loss") for r in rows)
