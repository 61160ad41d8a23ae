"""benchmarks/peers: the docs table is the records' table, and a run through the orchestrator leaves a record
(ours, tiny, one process on CPU) or a record that says why it failed (a run past its time limit)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.peers.report import records, table  # noqa: E402


def test_the_peers_table_in_docs_is_the_records_table():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    start = text.index("<!-- generated: peers -->\n") + len("<!-- generated: peers -->\n")
    end = text.index("<!-- end: peers -->")
    assert text[start:end].strip().splitlines() == table(records(), newest_only=True), "regenerate: python -m benchmarks tables"
    rows = records()
    assert {r["system"] for r in rows} >= {"seqpar", "torchtitan", "trl_cp", "deepspeed_alst"}
    assert all(r["gpu"] in ("H100", "H200") and r["commit"] and r["model"] and r["seq"] and r["gpus"] for r in rows)


def test_a_run_leaves_a_record_and_a_run_past_its_limit_says_so(tmp_path):
    out = tmp_path / "peers.json"
    env = dict(os.environ, OUT=str(tmp_path), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "benchmarks.peers", "--gpus", "1", "--seq", "64", "--out", str(out)]
    subprocess.run([*cmd, "--runs", "seqpar:llama3-8b+--tiny+--warmup+1", "--steps", "2", "--time-limit", "120"],
                   cwd=ROOT, env=env, check=True, timeout=180)
    # ascending lengths stop at a run's first failure: 63 is odd (refused), so 128 never runs
    subprocess.run([*cmd[:-4], "--seq", "63,128", "--out", str(out), "--runs", "seqpar:llama3-8b+--tiny", "--steps", "2",
                    "--time-limit", "120"], cwd=ROOT, env=env, check=True, timeout=180)
    subprocess.run([*cmd, "--runs", "seqpar:qwen3-8b+--tiny", "--steps", "2", "--time-limit", "1"], cwd=ROOT, env=env,
                   check=True, timeout=60)
    ok, odd, late = json.loads(out.read_text())
    assert odd["seq"] == 63 and odd["status"].startswith("error: ValueError") and "seq_len must be even" in odd["status"]
    assert ok["status"] == "ok" and ok["system"] == "seqpar" and ok["steps"] == 1 and ok["tokens_per_s_per_gpu"] > 0
    assert len(ok["step_times_s"]) == 2 and ok["settings"]["memory"] == "auto"
    assert late["status"] == "timeout" and late["model"] == "qwen3-8b"
    # every record says how long its whole run took (launch to exit: what the 10-minute budget counts)
    assert sum(ok["step_times_s"]) < ok["run_s"] < 120 and 0 < odd["run_s"] < 120 and 1 <= late["run_s"] < 60
    assert late["steps_done_s"] == []  # killed before its first step ended


def test_each_peer_launches_as_its_own_launcher_does():
    # torchtitan's run_train.sh, TRL's long-context guide and ALST set expandable segments; ours sets it in the strategy
    from benchmarks.peers.__main__ import command, launch_env

    for system in ("torchtitan", "trl_cp", "deepspeed_alst"):
        assert list(launch_env(system, {}).values()) == ["expandable_segments:True"]
    assert launch_env("seqpar", {}) == {}
    assert launch_env("trl_cp", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}) == {}  # the caller's wins
    # TRL's long-context example (checkpoints offloaded) is its own accelerate config, and the script records it
    long = command("trl_cp", 1024, 4, 2, "o.json", ["--ckpt-offload"])
    assert long[long.index("--config_file") + 1].endswith("accelerate_cp_long.yaml") and "--ckpt-offload" in long
    short = command("trl_cp", 1024, 4, 2, "o.json", [])
    assert short[short.index("--config_file") + 1].endswith("accelerate_cp.yaml")
    config = open(long[long.index("--config_file") + 1]).read()
    assert "fsdp_activation_checkpointing_offload: true" in config and "parallelism_config_cp_size: 4" in config


def test_a_run_out_of_time_keeps_the_steps_it_finished():
    # the step clock's lines, also behind a progress bar's carriage return (TRL / ALST print one)
    from benchmarks.peers.__main__ import steps_done

    log = ("loading\n[peers] step 1: 257.853 s\n\r 50%|#####     | 1/2 [03:22<03:22, 202.91s/it][peers] step 2: 196.123 s\n"
           "[peers] seqpar qwen3-8b S=720896: 196.1 s/step\n")
    assert steps_done(log) == [257.853, 196.123]
    assert steps_done("Traceback ...\nOutOfMemoryError") == []


def test_packed_documents_of_ours_cut_rows_and_their_labels():
    """ours.py --documents N: N equal documents per row (the last takes the remainder), no label across a boundary."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
    from ours import packed_copy_task

    from lightning_seqpar.data import LongRangeDataModule

    plain = LongRangeDataModule(vocab_size=64, seq_len=10, batch_size=1, num_samples=2, val_samples=0, supervise="all")
    packed = packed_copy_task(LongRangeDataModule, 3)(vocab_size=64, seq_len=10, batch_size=1, num_samples=2, val_samples=0,
                                                      supervise="all")
    row, base = packed._dataset(2, 0)[1], plain._dataset(2, 0)[1]
    assert row["document_ids"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    assert (row["input_ids"] == base["input_ids"]).all()
    ends = [2, 5]
    assert all(row["labels"][i] == -100 for i in ends)
    keep = [i for i in range(10) if i not in ends]
    assert (row["labels"][keep] == base["labels"][keep]).all()


def test_the_longest_lengths_table_walks_each_system_to_its_first_limit():
    from benchmarks.peers.report import longest

    def run(system, seq, status="ok", **extra):
        return dict(system=system, model="qwen3-8b", seq=seq, gpus=4, gpu="H200", group="s", status=status, **extra)

    rows = [run("trl_cp", 262144), run("trl_cp", 524288), run("trl_cp", 655360, "oom: CUDA out of memory"),
            run("deepspeed_alst", 262144), run("deepspeed_alst", 393216, "timeout"),
            run("seqpar", 524288), run("seqpar", 786432, step_time_s=300.0), run("seqpar", 1048576, "oom", defect="the estimate (fixed)"),
            run("seqpar", 1048576, "timeout")]
    lines = longest(rows)
    assert lines[2:] == [
        '| <a id="peers-longest-qwen3-8b-4"></a>qwen3-8b | 4 x H200 | s | seqpar | 786,432 | 300.0 | - | 1,048,576: timeout | 1.50x (> 1.20x) |',
        "| qwen3-8b | 4 x H200 | s | deepspeed_alst | 262,144 | - | - | 393,216: timeout | - |",
        "| qwen3-8b | 4 x H200 | s | trl_cp | 524,288 | - | - | 655,360: oom | - |",
    ]
    assert longest([run("trl_cp", 131072), run("seqpar", 131072)])[2:] == []  # nobody met a limit at 128K: no rows
    # a run for the longest (above 128K) shows its run group; a row of packed documents is its own system, not a dense length
    lines = longest([run("trl_cp", 524288), run("seqpar", 655360), run("seqpar", 1048576, documents=16),
                     dict(run("seqpar", 262144), group="r")])  # an older group: below the newest, under its anchor
    assert lines[2:] == [
        '| <a id="peers-longest-qwen3-8b-4"></a>qwen3-8b | 4 x H200 | s | seqpar | 655,360 | - | - | none tried | 1.25x |',
        "| qwen3-8b | 4 x H200 | s | seqpar (16 packed documents) | 1,048,576 | - | - | none tried | 2.00x |",
        "| qwen3-8b | 4 x H200 | s | trl_cp | 524,288 | - | - | none tried | - |",
        "| qwen3-8b | 4 x H200 | r | seqpar | 262,144 | - | - | none tried | - |",
    ]
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    start = text.index("<!-- generated: peers-longest -->\n") + len("<!-- generated: peers-longest -->\n")
    assert text[start:text.index("<!-- end: peers-longest -->")].strip().splitlines() == longest(records())


def test_packed_documents_count_attention_within_each_document():
    """MFU of a row cut into N packed documents counts causal attention over each document (S / N), not the row: the
    Qwen3-8B 1M run with 16 documents read 3.40 before (4 x H200, 2026-11-27, f752977; its record is recounted and says so)."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
    from common import SHAPES

    q = SHAPES["qwen3-8b"]
    dense, packed = q.flops_per_token(1048576), q.flops_per_token(1048576, 16)
    assert dense - 6 * q.params() == 16 * (packed - 6 * q.params())
    assert q.flops_per_token(65536) == packed and q.flops_per_token(4096, 0) == q.flops_per_token(4096, 1)

    rows = json.load(open(ROOT / "benchmarks" / "results" / "20261127-nvidia-h200-x4-peers-5.json"))
    one_m = next(r for r in rows if r["seq"] == 1048576)
    assert one_m["documents"] == 16 and 0.3 < one_m["mfu"] < 0.5
    assert one_m["mfu"] == pytest.approx(one_m["tokens_per_s_per_gpu"] * packed / 989e12)


def test_the_physical_bound_of_a_step():
    # Note [The step's physical bound]: docs/benchmarks.md's 3,460 tokens/s/GPU for the Qwen3-8B shape at 128K on H200
    from benchmarks.peers.common import SHAPES, bound_tokens_per_s

    qwen = SHAPES["qwen3-8b"]
    assert bound_tokens_per_s(qwen, 131072, "H200") == pytest.approx(3460, rel=0.005)
    # attention grows with the length: at 640K the bound is 835 (ours measured 800.6 there, 0.96 of it)
    assert bound_tokens_per_s(qwen, 655360, "H200") == pytest.approx(835, rel=0.005)
    # 16 packed documents of 64K: attention within each document, as a dense 64K row
    assert bound_tokens_per_s(qwen, 1 << 20, "H200", documents=16) == bound_tokens_per_s(qwen, 1 << 16, "H200")
    assert bound_tokens_per_s(qwen, 131072, "H100") is None  # no rates measured on H100
