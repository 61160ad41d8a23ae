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
    # ascending lengths go on after a run's "ok" and stop at its first failure: 64 trains, 65 is odd (refused), so
    # 128 never runs (one harness for both: each start of it and of its torchrun imports torch)
    subprocess.run([*cmd[:-4], "--seq", "64,65,128", "--out", str(out), "--runs", "seqpar:llama3-8b+--tiny+--warmup+1",
                    "--steps", "2", "--time-limit", "120"], cwd=ROOT, env=env, check=True, timeout=300)
    subprocess.run([*cmd, "--runs", "seqpar:qwen3-8b+--tiny", "--steps", "2", "--time-limit", "1"], cwd=ROOT, env=env,
                   check=True, timeout=60)
    ok, odd, late = json.loads(out.read_text())
    assert odd["seq"] == 65 and odd["status"].startswith("error: ValueError") and "seq_len must be even" in odd["status"]
    assert ok["status"] == "ok" and ok["system"] == "seqpar" and ok["steps"] == 1 and ok["tokens_per_s_per_gpu"] > 0
    assert len(ok["step_times_s"]) == 2 and ok["settings"]["memory"] == "auto"
    assert late["status"] == "timeout" and late["model"] == "qwen3-8b"
    # every record says how long its whole run took (launch to exit: what the 10-minute budget counts)
    assert sum(ok["step_times_s"]) < ok["run_s"] < 120 and 0 < odd["run_s"] < 120 and 1 <= late["run_s"] < 60
    assert late["steps_done_s"] == []  # killed before its first step ended
    # issue #56: the harness's own measures on every record, a failed one too (Note [One measurement for every peer])
    assert ok["master_weights"] == "fp32" and ok["memory"]["probe"]["steps"] == 2 and ok["memory"]["host"]["peak_rss_gb"] > 0
    assert ok["flags"] == ["--tiny", "--warmup", "1"] and "not profiled" in ok["kernels"]["why"]  # no warm-up step 2
    assert "old measure" in ok["peak_mem_measure"] and late["memory"]["host"]["peak_rss_gb"] >= 0


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
    # a run that failed with an error (a kernel that did not load) is not a length's limit: no rows either
    failed = run("deepspeed_alst", 65536, "error: ModuleNotFoundError: No module named 'cutlass.cute'", flags=["--liger"])
    assert longest([run("trl_cp", 65536), run("seqpar", 65536), failed])[2:] == []
    from benchmarks.peers.report import variant

    assert variant(dict(failed, flags=["--liger", "--attn", "flash_attention_4"])) == "liger, attn flash_attention_4"
    assert variant(dict(failed, flags=[])) == "as published" and variant(dict(failed, settings={"variant": "liger"})) == "liger"
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


# ---- issue #56: one memory measure, the master weights and the kernels, read outside each system's code ----------

def _probe_module():
    """probe/sitecustomize.py loaded under another name (as a module it installs nothing: only as `sitecustomize`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("peers_probe_under_test", ROOT / "benchmarks" / "peers" / "probe" / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _StubCuda:
    """torch.cuda's memory counters as the allocator keeps them: a peak that a reset brings down to what is held now."""

    def __init__(self):
        self.held, self.peak, self.memory = 0, 0, None

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def max_memory_reserved(self):
        return self.peak

    def max_memory_allocated(self):
        return self.peak // 2

    def memory_reserved(self):
        return self.held

    def reset_peak_memory_stats(self, device=None):
        self.peak = self.held

    def synchronize(self):
        pass


def test_the_probe_keeps_its_running_max_through_a_peers_resets(tmp_path):
    """torchtitan's logger resets the peak every step (its old column read 32.3 GB where it reserved ~147 GB): the probe
    reads the peak before every reset and after every optimizer step, and keeps the max."""
    import types

    import torch

    probe_module = _probe_module()
    cuda = _StubCuda()
    probe = probe_module.Probe(types.SimpleNamespace(cuda=cuda), str(tmp_path))
    probe.wrap_reset()
    optimizer = types.SimpleNamespace(param_groups=[{"params": [torch.zeros(1)]}])

    def step(peak, held, reset_inside=False):
        probe.backwards += 1  # the step's backward
        cuda.held, cuda.peak = held, max(cuda.peak, peak)
        if reset_inside:  # the peer's logger, before the optimizer's step ends
            cuda.reset_peak_memory_stats()
        probe.pre(optimizer, (), {})
        probe.post(optimizer, (), {})

    step(100e9, 40e9)
    cuda.reset_peak_memory_stats()  # a reset between steps
    step(120e9, 30e9, reset_inside=True)  # a peak that only the read before the reset sees
    step(50e9, 30e9)
    assert cuda.peak == 50e9 and probe.reserved == 120e9 and probe.allocated == 60e9 and probe.resets == 2
    assert probe.current_reserved == 40e9 and probe.steps == 3 and probe.master_weights == "fp32"
    (written,) = tmp_path.glob("probe-0-*.json")
    state = json.loads(written.read_text())
    assert state["peak_reserved_gb"] == 120 and state["resets_seen"] == 2 and state["optimizer"] == "SimpleNamespace"
    # a wrapped reset is not wrapped twice, and torch.cuda.memory's own name is wrapped too
    cuda.memory = types.SimpleNamespace(reset_peak_memory_stats=cuda.reset_peak_memory_stats)
    wrapped = cuda.reset_peak_memory_stats
    probe.wrap_reset()
    assert cuda.reset_peak_memory_stats is wrapped


def test_the_probe_counts_training_steps_not_optimizer_calls():
    """torchtitan's OptimizersContainer steps its inner optimizer inside its own step (nested); DeepSpeed ZeRO-3 steps
    its inner optimizer once per parameter sub-group (no backward between): each is one training step."""
    import types

    import torch

    probe = _probe_module().Probe(types.SimpleNamespace(cuda=_StubCuda()), None)
    bf16 = types.SimpleNamespace(param_groups=[{"params": []}, {"params": [torch.zeros(1, dtype=torch.bfloat16)]}])
    for _ in range(2):  # torchtitan: container(inner)
        probe.backwards += 1
        probe.pre(bf16, (), {}), probe.pre(bf16, (), {}), probe.post(bf16, (), {}), probe.post(bf16, (), {})
    assert probe.steps == 2 and probe.master_weights == "bf16"
    for _ in range(2):  # ZeRO-3: three sub-groups per step
        probe.backwards += 1
        for _ in range(3):
            probe.pre(bf16, (), {}), probe.post(bf16, (), {})
    assert probe.steps == 4


def test_the_probe_names_the_attention_kernel_and_the_fused_kernels():
    summarize = _probe_module().summarize
    fa4 = "kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at_0x7f"
    rows = [("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>(Flash_fwd_params)", 32, 400.0),
            ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", 900, 2000.0),
            ("_rms_norm_forward_kernel", 65, 30.0), ("triton_poi_fused_mul_silu_0", 32, 20.0),
            ("fmha_cutlassB_bf16_aligned_64x64_k128_sm80(PyTorchMemEffAttention::AttentionKernel)", 32, 100.0)]
    s = summarize(rows)
    assert s["attention"] == "torch SDPA flash (flash-attention 2 in torch)" and s["top"][0]["calls"] == 900
    assert s["attention_ms"] == {"torch SDPA flash (flash-attention 2 in torch)": 400.0,
                                 "torch SDPA memory-efficient (cutlass fmha)": 100.0}
    assert s["liger"] and s["liger_kernels"] == ["_rms_norm_forward_kernel"] and s["triton_generated_ms"] == 20.0
    assert summarize([(fa4, 64, 900.0)])["attention"] == "flash-attention 4 (CuTe DSL)"
    assert summarize([("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_128x128x128", 32, 5.0),
                      ("cudnn::bn_fw_tr_1C11_kernel_NCHW", 9, 50.0)])["attention"] == "cuDNN SDPA"
    assert summarize([("void flash::FlashAttnFwdSm90<...>", 1, 1.0)])["attention"] == "flash-attention 3"
    assert summarize([("ampere_bf16_s16816gemm", 1, 1.0)])["attention"] == "none found"
    assert not summarize([("ampere_bf16_s16816gemm", 1, 1.0)])["liger"]


def test_a_peers_record_carries_the_probe_and_the_poller(tmp_path):
    """What the harness adds to every record: the probe's reserved peak (the tables' column), master weights, kernels
    (rank 0's), the poller's device / host peaks; the old column kept and labelled, and said to be no peak when the
    system reset it."""
    from benchmarks.peers.__main__ import merge_measures, probe_results

    kernels = dict(step=2, attention="flash-attention 4 (CuTe DSL)")
    for rank, reserved, resets in ((0, 130.4, 5), (1, 131.2, 5)):
        (tmp_path / f"probe-{rank}-1{rank}.json").write_text(json.dumps(dict(
            rank=rank, steps=5, optimizer="AdamW", master_weights="fp32", peak_reserved_gb=reserved, peak_allocated_gb=100.0,
            max_current_reserved_gb=90.0, resets_seen=resets, host_maxrss_gb=12.5, kernels=kernels if rank == 0 else None)))
    probed = probe_results(str(tmp_path))
    assert probed["peak_reserved_gb"] == 131.2 and probed["master_weights"] == "fp32" and probed["kernels"] == kernels
    # rank 0's timeline of the profiled step, when the probe exported one: split by part (Note [Where the step goes])
    (tmp_path / "trace-0.json").write_text(json.dumps({"traceEvents": [dict(
        ph="X", cat="kernel", name="nvjet_tst_192x192", pid=0, tid=7, ts=0, dur=100, args=dict(stream=7))]}))
    where = probe_results(str(tmp_path))["kernels"]["where"]
    assert where["parts_s"] == {"gemm": 1e-4} and where["busy_s"] == 1e-4
    (tmp_path / "trace-0.json").write_text("{")
    assert probe_results(str(tmp_path))["kernels"]["where"]["why"].startswith("trace not read")
    (tmp_path / "trace-0.json").unlink()
    assert probed["attention_kernel"] == "flash-attention 4 (CuTe DSL)" and probed["probe"]["host_maxrss_gb_sum"] == 25.0
    polled = dict(device=dict(source="nvml (nvidia-ml-py)", peak_gb=140.1), host=dict(peak_rss_gb=30.0))
    row = merge_measures(dict(system="torchtitan", peak_mem_gb=32.3), probed, polled, ["--compile"])
    assert row["peak_reserved_gb"] == 131.2 and row["flags"] == ["--compile"] and "not a peak" in row["peak_mem_measure"]
    assert row["memory"]["device"]["peak_gb"] == 140.1 and row["memory"]["probe"]["resets_seen"] == [5, 5]
    assert probe_results(str(tmp_path / "none")) == {}


def test_the_memory_poller_reads_the_process_tree_and_the_timed_steps(tmp_path):
    from benchmarks.peers.__main__ import MemoryPoller

    log = tmp_path / "run.log"
    log.write_text("[peers] step 1: 3.0 s\n")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.2)"])
    poller = MemoryPoller(proc.pid, str(log), warmup=2, interval=0.05)
    poller.start()
    import time

    time.sleep(0.4)
    with open(log, "a") as f:
        f.write("[peers] step 2: 3.0 s\n")
    proc.wait()
    out = poller.stop()
    assert out["host"]["peak_rss_gb"] > 0 and out["samples"] >= 5 and out["timed_from_s"] is not None
    assert out["device"]["source"]  # nvml, nvidia-smi, or says there is neither


def test_each_peers_best_settings_are_run_flags():
    """`--runs "torchtitan+--compile+--ac+full,trl_cp+--liger,deepspeed_alst+--liger+--attn+flash_attention_4"`: each
    '+' flag reaches the peer's runner, the TRL / ALST degree follows the GPUs, and the runners refuse what cannot run."""
    from benchmarks.peers.__main__ import command, parse_run, warmup_of

    assert parse_run("torchtitan+--compile+--ac+full") == ("torchtitan", ["--compile", "--ac", "full"])
    assert parse_run("seqpar:qwen3-8b") == ("seqpar:qwen3-8b", [])
    titan = command("torchtitan", 65536, 2, 5, "o.json", parse_run("torchtitan+--compile+--ac+full")[1])
    assert titan[-3:] == ["--compile", "--ac", "full"] and titan[titan.index("--nproc_per_node") + 1] == "2"
    alst = command("deepspeed_alst", 65536, 2, 5, "o.json", parse_run("deepspeed_alst+--liger+--attn+flash_attention_4")[1])
    assert alst[alst.index("--parallelism_config_sp_size") + 1] == "2" and alst[-3:] == ["--liger", "--attn", "flash_attention_4"]
    cp = command("trl_cp", 65536, 2, 5, "o.json", ["--liger"])
    assert cp[cp.index("--parallelism_config_cp_size") + 1] == "2"
    assert warmup_of([]) == 2 and warmup_of(["--tiny", "--warmup", "3"]) == 3 and warmup_of(["--warmup=1"]) == 1

    sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
    import trl_sft

    assert "SDPA" in trl_sft.attention_check("trl_cp", "flash_attention_4")
    assert trl_sft.attention_check("deepspeed_alst", "sdpa") is None and "one of" in trl_sft.attention_check("deepspeed_alst", "fa9")
    assert "not importable here: flash-attn (PyPI ships only its sdist" in trl_sft.attention_check("deepspeed_alst", "flash_attention_2")


def test_alst_takes_flash_attention_4_through_accelerates_name_check(monkeypatch):
    """accelerate 1.15 lists sdpa / flash_attention_2 / _3 / Hub kernels; the runner lets flash_attention_4 through
    that one check and nothing else."""
    pytest.importorskip("accelerate")
    from accelerate.utils import dataclasses as accelerate_dataclasses

    sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
    import trl_sft

    cls = accelerate_dataclasses.DeepSpeedSequenceParallelConfig
    monkeypatch.setattr(cls, "__post_init__", cls.__post_init__)  # restored after the test
    monkeypatch.delenv("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION", raising=False)
    with pytest.raises(ValueError, match="Invalid sp_attn_implementation"):
        cls(sp_attn_implementation="flash_attention_4")
    trl_sft.let_accelerate_take("flash_attention_4")
    assert cls(sp_attn_implementation="flash_attention_4").sp_attn_implementation == "flash_attention_4"
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION", "flash_attention_4")
    assert cls().sp_attn_implementation == "flash_attention_4"
    with pytest.raises(ValueError, match="Invalid sp_attn_implementation"):
        cls(sp_attn_implementation="eager")


def test_the_peers_table_reads_one_memory_measure_and_labels_the_old_one():
    from benchmarks.peers.report import table

    def row(system, tps, **extra):
        return dict(system=system, model="qwen3-8b", seq=65536, gpus=2, gpu="H200", group="g", status="ok",
                    tokens_per_s_per_gpu=tps, mfu=0.4, commit="c", version="v", **extra)

    rows = [row("seqpar", 3000.0, peak_reserved_gb=131.24, peak_mem_gb=120.0, master_weights="fp32",
                attention_kernel="flash-attention 4 (CuTe DSL)", settings=dict(precision="bf16-mixed")),
            row("trl_cp", 2500.0, peak_reserved_gb=60.0, peak_mem_gb=46.3, master_weights="fp32",
                attention_kernel="cuDNN SDPA", settings=dict(variant="liger")),
            row("trl_cp", 2000.0, peak_mem_gb=46.3, settings={}),
            row("torchtitan", 2400.0, peak_mem_gb=32.3, peak_reserved_gb_from_log=147.15,
                peak_mem_measure="...; torchtitan's logger resets the peak every logged step, so not a peak"),
            row("torchtitan", 2300.0, peak_mem_gb=32.2, peak_mem_measure="... so not a peak (no torchtitan log kept)")]
    header, _, *lines = table(rows)
    assert "peak reserved GB | master weights | attention kernel (profiled)" in header
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in lines]
    ours, *peers = cells
    assert ours[4] == "seqpar" and ours[7] == "1.20x" and ours[10:13] == ["131.2", "fp32", "flash-attention 4 (CuTe DSL)"]
    by_system = {c[4]: c for c in peers}
    assert by_system["trl_cp, liger"][10:13] == ["60.0", "fp32", "cuDNN SDPA"]
    assert by_system["trl_cp, as published"][10:13] == ["46.3 alloc (old)", "-", "-"]
    from benchmarks.peers.report import kernels_in_timed_steps

    assert not kernels_in_timed_steps(dict(warmup=2, kernels=dict(step=2))) and kernels_in_timed_steps(dict(warmup=2, kernels=dict(step=3)))
    assert not kernels_in_timed_steps(dict(kernels=dict(step=0, why="not profiled"))) and not kernels_in_timed_steps({})
    titans = [c for c in peers if c[4] == "torchtitan, as published"]
    assert [c[10] for c in titans] == ["147.2 (its log)", "32.2 alloc (old, reset by its logger: no peak)"]


def test_the_where_table_sets_each_systems_profiled_step_side_by_side():
    """Issue #56 item 2: the newest group's profiled steps split by part, one row per system, with the bound's seconds."""
    from benchmarks.peers.report import WHERE_PARTS, where_table

    def row(system, group, attention_s, waited):
        where = dict(step_s=10.6, parts_s={"attention backward": attention_s, "gemm": 2.3}, busy_s=10.0,
                     comm_s=dict(kernels=1.1, waited=waited, waited_on_comm=waited, on_compute_stream=0.0),
                     idle_s=dict(host=0.05, wait=waited, edge=0.0))
        return dict(system=system, model="llama3-8b", seq=131072, gpus=4, gpu="H200", group=group, commit="c",
                    settings={}, kernels=dict(step=2, where=where))

    rows = [row("torchtitan", "20261128", 5.4, 0.3), row("seqpar", "20261128", 5.5, 0.1), row("seqpar", "20261127", 9.9, 9.9),
            dict(system="trl_cp", model="llama3-8b", seq=131072, gpus=4, gpu="H200", group="20261128", kernels=dict(step=2))]
    header, _, *lines = where_table(rows)
    assert header.count("|") == 12 + len(WHERE_PARTS)
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in lines]
    assert [c[4] for c in cells] == ["seqpar", "torchtitan, as published"]  # the newest group only; no split, no row
    backward, gemm = WHERE_PARTS.index("attention backward"), WHERE_PARTS.index("gemm")
    assert cells[0][6 + backward] == "5.50" and cells[0][6 + gemm] == "2.30" and cells[1][6 + backward] == "5.40"
    assert cells[0][-4:-1] == ["0.10", "0.05", "8.61"]  # waited on comm, host idle, the bound's seconds (32K tokens at 3,808/s)


def test_a_peer_whose_modules_are_missing_is_refused_before_its_launch(tmp_path, monkeypatch):
    """A run whose runner could not import what it needs (2026-11-28: torchtitan without ``datasets``, a minute of
    device time to learn it) leaves an error record naming the modules, without launching torchrun."""
    import importlib.util

    from benchmarks.peers import __main__ as peers

    monkeypatch.setitem(peers.NEEDS, "fake", ("json", "no_such_module_of_seqpar"))
    assert peers.missing_modules("fake", [], dict(os.environ)) == ["no_such_module_of_seqpar"]
    assert peers.missing_modules("seqpar", [], dict(os.environ)) == []
    if importlib.util.find_spec("torchtitan") is not None:
        pytest.skip("torchtitan is installed here: the end-to-end refusal needs it missing")
    out = tmp_path / "peers.json"
    env = dict(os.environ, OUT=str(tmp_path), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "benchmarks.peers", "--gpus", "1", "--seq", "64", "--out", str(out), "--runs",
                    "torchtitan+--compile"], cwd=ROOT, env=env, check=True, timeout=120)
    (row,) = json.loads(out.read_text())
    assert row["system"] == "torchtitan" and row["status"].startswith("error: not launched: ModuleNotFoundError")
    assert "torchtitan" in row["status"] and row["run_s"] < 60 and row["flags"] == ["--compile"]
    assert "not launched" in (tmp_path / "torchtitan-compile-64.log").read_text()
