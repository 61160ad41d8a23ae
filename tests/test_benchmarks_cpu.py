"""The benchmark tools on CPU: the Megatron-style TP+SP baseline (benchmarks/train.py, Note [The TP+SP baseline])
trains the same model as one device, benchmarks/report.py checks and merges records and makes the tables."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

from dist_utils import _free_port, run_distributed  # noqa: E402


def _tp_sp_vs_one_device(rank: int, world_size: int, name: str, steps: int) -> list[tuple[float, float]]:
    import copy

    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from lightning_seqpar.data import LongRangeDataModule
    from lightning_seqpar.models import Llama, LlamaConfig
    from train import parallelize_tp_sp

    cfg = LlamaConfig.from_name(name)
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("data_parallel", "tensor_parallel"))
    torch.manual_seed(0)
    model = Llama(cfg)
    ref = copy.deepcopy(model)
    layout = parallelize_tp_sp(model, mesh, loss_parallel=True, activation_checkpointing=True, param_dtype=None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    data = LongRangeDataModule(vocab_size=cfg.vocab_size, seq_len=64, batch_size=2, num_samples=8, val_samples=0, seed=0)
    data.setup("fit")
    losses = []
    for _, batch in zip(range(steps), data.train_dataloader()):
        ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
        with loss_parallel():
            loss = F.cross_entropy(model(ids, pos).flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
            loss.backward()
        ref_loss = F.cross_entropy(ref(ids, pos).flatten(0, 1), labels.flatten(), ignore_index=-100)
        ref_loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=True)
        losses.append((loss.full_tensor().item(), ref_loss.item()))
    if layout.padded:  # dummy heads get zero gradients, so they stay zero (Note [Heads that do not divide W])
        attn = model.layers[0].self_attn
        q = attn.q_proj.weight.full_tensor().view(layout.n_head, cfg.head_dim, -1)
        o = attn.o_proj.weight.full_tensor().view(-1, layout.n_head, cfg.head_dim)
        assert q[cfg.n_head:].abs().max().item() == 0 and o[:, cfg.n_head:].abs().max().item() == 0
    return losses


@pytest.mark.parametrize("name", ["tiny", "tiny-3h"])  # GQA; 3 heads padded to 4 (W = 2)
def test_tp_sp_matches_one_device(name):
    losses = run_distributed(_tp_sp_vs_one_device, 2, name, 3)[0]
    tp, ref = zip(*losses)
    assert tp == pytest.approx(ref, rel=1e-5, abs=2e-6)
    assert abs(ref[-1] - ref[0]) > 1e-3  # the steps changed the model: later losses check the gradients


def test_tp_sp_repeated_kv_heads_start_equal():
    # MQA on 2 ranks: the one K/V head is repeated to 2. Equal at init; the copies then train apart
    # (each gets the gradient of its own query heads), so only the first loss is the model's.
    (tp, ref), *_ = run_distributed(_tp_sp_vs_one_device, 2, "tiny-mqa", 1)[0]
    assert tp == pytest.approx(ref, rel=1e-5, abs=2e-6)


def test_head_layout():
    from lightning_seqpar.models import LlamaConfig
    from train import head_layout

    assert head_layout(LlamaConfig.from_name("llama-33h"), 4) == head_layout(LlamaConfig.from_name("llama-33h"), 4)
    lay = head_layout(LlamaConfig.from_name("llama-33h"), 4)
    assert (lay.n_head, lay.n_kv_head, lay.padded, lay.kv_repeat) == (36, 36, 3, 1)
    lay = head_layout(LlamaConfig.from_name("llama3-8b"), 16)
    assert (lay.n_head, lay.n_kv_head, lay.padded, lay.kv_repeat) == (32, 16, 0, 2)
    with pytest.raises(ValueError, match="not divisible"):
        head_layout(LlamaConfig.from_name("llama3-8b"), 3)


@pytest.mark.timeout(300)
def test_train_several_lengths_in_one_process(tmp_path):
    """benchmarks/train.py --seqs / --models: one record per run, and nothing carries over between the runs of
    one process (S = 128 trains the same losses before and after S = 64); S:STEPS sets the timed steps.

    Two ranks, each a process of its own with the environment torchrun gives its workers (RANK, LOCAL_RANK,
    WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, TORCHELASTIC_RUN_ID, MASTER_*: Lightning then takes its
    TorchElasticEnvironment, as under torchrun), forked from the pools' server (Note [Processes forked from the
    server] in dist_utils: no new interpreter importing Lightning); torchrun's own launch of train.py is
    test_benchmarks_driver's and test_longest_passes_offload_params_through's."""
    import train
    from dist_utils import ForkedProcess, _free_port

    out = tmp_path / "train.json"
    argv = ["--device", "cpu", "--system", "seqpar", "--models", "tiny,tiny-mha", "--seqs", "128,64:2,128", "--warmup", "1",
            "--steps", "1", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2",
               LOCAL_WORLD_SIZE="2", GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE="2", TORCHELASTIC_RUN_ID="none")
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    ranks = [ForkedProcess(train.main, (argv,), dict(env, RANK=str(r), LOCAL_RANK=str(r), ROLE_RANK=str(r)), str(logs[r]))
             for r in range(2)]
    try:
        codes = [p.wait(timeout=280) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    rows = json.loads(out.read_text())
    runs = [[m, s] for s in (128, 64, 128) for m in ("tiny", "tiny-mha")]  # each length for both models in turn
    assert [[r["model"], r["seq"]] for r in rows] == runs
    assert all(r["in_process"] == runs and r["gpus"] == 2 for r in rows)
    assert [len(r["losses"]) for r in rows] == [2, 2, 3, 3, 2, 2]  # warm-up + steps (64:2 times two steps)
    assert rows[0]["losses"] == rows[4]["losses"] and rows[1]["losses"] == rows[5]["losses"]
    assert rows[0]["losses"] != rows[1]["losses"]  # the models differ
    assert rows[0]["losses"] != rows[2]["losses"][:2]


@pytest.mark.timeout(300)
def test_longest_passes_offload_params_through(tmp_path, monkeypatch, capsys):
    """benchmarks/longest.py ... -- --offload-params: train.py runs seqpar with offload_params=True (and
    longest's --prealloc-optimizer step over the host shards), and both records say so; tp_sp refuses it."""
    import shutil

    import longest
    import train

    if shutil.which("torchrun") is None:
        pytest.skip("no torchrun on PATH")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)

    with pytest.raises(SystemExit) as refused:  # argparse's error, before anything runs (in process: no launch)
        train.main(["--system", "tp_sp", "--device", "cpu", "--offload-params"])
    assert refused.value.code == 2 and "--offload-params is for --system seqpar and torch_cp" in capsys.readouterr().err
    log = tmp_path / "longest.log"
    # one process: the two-process runs of train.py are test_train_several_lengths_in_one_process's
    row = longest.main(["--system", "seqpar", "--model", "tiny", "--nproc", "1", "--seqs", "64:240", "--device", "cpu",
                        "--log", str(log), "--", "--offload-params", "--loss-chunk", "16", "--optimizer", "default"])
    assert row["seq"] == 64, log.read_text()[-3000:]
    assert row["offload_params"] is True and row["train_args"] == "--offload-params --loss-chunk 16 --optimizer default"
    assert row["optimizer"] == "default"
    assert "host_peak_gb" in row


@pytest.mark.timeout(300)
def test_offload_optimizer_times_each_implementation(tmp_path):
    """benchmarks/train.py host-adamw: one record per implementation and thread count, step time scaled
    from the materialised blocks to the model's per-rank parameter count."""
    import train
    from dist_utils import ForkedProcess, _free_port

    # a process of its own (the script starts a world-1 process group), forked from the pools' server
    out, log = tmp_path / "opt.json", tmp_path / "opt.log"
    argv = ["host-adamw", "--model", "tiny", "--ranks", "2", "--layers", "1", "--threads", "2", "--steps", "1", "--out", str(out), "--commit", "abc"]
    with ForkedProcess(train.main, (argv,), {**os.environ, "MASTER_PORT": str(_free_port())}, str(log)) as run:
        assert run.wait(timeout=240) == 0, log.read_text()[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["algorithm"], r["threads"]) for r in rows] == [(i, t) for t in (1, 2) for i in ("forloop", "foreach", "fused")]
    from lightning_seqpar.models import Llama, LlamaConfig

    with torch.device("meta"):
        full = Llama(LlamaConfig.from_name("tiny"))
    assert all(r["params_per_rank"] == sum((p.shape[0] + 1) // 2 * p[0].numel() for p in full.parameters()) for r in rows)
    assert all(r["step_s"] > 0 and r["gb_per_s"] > 0 and r["bench"] == "offload_optimizer" and r["commit"] == "abc" for r in rows), rows


def _record(**kw):
    row = dict(bench="train", system="seqpar", algorithm="ring", model="llama3-8b", seq=131072, gpus=4, device="NVIDIA H200",
               tokens_per_s_per_gpu=2799.0, mfu=0.419, peak_mem_gb=65.6, commit="abc1234")
    row.update(kw)
    return row


def test_collect_merges_deduplicates_and_validates(tmp_path):
    from benchmarks import report

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps([_record(), _record(seq=262144)]))
    b.write_text(json.dumps([_record(), {"bench": "matmul", "device": "NVIDIA H200", "tflops": 800.0, "commit": "x"}]))
    out = report.collect_main(["--kind", "nvidia-h200-x4", "--date", "20261122", "--results", str(tmp_path / "res"), str(a), str(b)])
    rows = json.loads(open(out).read())
    assert out.endswith("20261122-nvidia-h200-x4.json") and len(rows) == 3
    # merging again adds nothing
    report.collect_main(["--kind", "nvidia-h200-x4", "--date", "20261122", "--results", str(tmp_path / "res"), str(a)])
    assert len(json.loads(open(out).read())) == 3
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([_record(mfu=None), {k: v for k, v in _record().items() if k != "commit"}]))
    with pytest.raises(SystemExit, match=r"record 0 .*mfu.*\n.*record 1 .*commit"):
        report.collect_main(["--kind", "nvidia-h200-x4", "--date", "20261122", "--results", str(tmp_path / "res"), str(bad)])


def test_profile_summary_categories():
    """benchmarks/profile_summary.py: kernel names fall in the right category; a CPU profile of attention
    + a matmul shows both."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from lightning_seqpar.attention import local_attention
    from profile_summary import category, format_summary, summarize

    assert category("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)") == "comm"
    assert category("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90") == "attention"
    assert category("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0") == "attention"
    assert category("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNN") == "gemm"
    assert category("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel>") == "other"
    q = torch.randn(1, 32, 2, 8, requires_grad=True)
    w = torch.randn(8, 8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = local_attention(q, q, q) @ w
        out.sum().backward()
    s = summarize(prof, 1.0)
    assert s["source"].startswith("cpu")
    assert s["categories_s"]["attention"] > 0 and s["categories_s"]["gemm"] > 0
    assert abs(s["compute_s"] - sum(v for k, v in s["categories_s"].items() if k != "comm")) < 1e-12
    assert "attention" in format_summary(s)


def test_profile_idle_gaps_classified():
    """profile_summary.idle_gaps on a hand-made trace: a gap whose kernel was launched late is 'host' and
    charged to the launching thread's op stack; a gap of a kernel queued in time is 'wait' and charged to
    the NCCL kernel it waited for; the edges are the step minus the kernels' span."""
    from profile_summary import format_gaps, idle_gaps

    def k(name, ts, dur, stream, corr):
        return dict(ph="X", cat="kernel", name=name, pid=0, tid=stream, ts=ts, dur=dur, args=dict(stream=stream, correlation=corr))

    def launch(ts, corr, tid=1):
        return dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", pid=9, tid=tid, ts=ts, dur=2, args=dict(correlation=corr))

    def op(name, ts, dur, tid=1):
        return dict(ph="X", cat="cpu_op", name=name, pid=9, tid=tid, ts=ts, dur=dur)

    events = [
        k("nvjet_gemm", 0, 100, 7, 1), launch(-10, 1),
        # kernel 2 launched at 150, after kernel 1 ended at 100: 60 us host gap, while thread 1 ran Optimizer > foreach
        k("vectorized_elementwise_kernel", 160, 40, 7, 2), launch(150, 2),
        op("Optimizer.step#AdamW.step", 90, 100), op("aten::_foreach_mul_", 110, 30), op("aten::empty", 112, 2),
        # kernel 3 queued at 170 but starts at 400: waited for the SendRecv ending at 399
        k("flash_fwd", 400, 500, 7, 3), launch(170, 3),
        k("ncclDevKernel_SendRecv", 150, 249, 20, 4), launch(140, 4),
        # a comm-only stream with more time must not be taken for the compute stream
        k("ncclDevKernel_AllGather", 0, 2000, 21, 5), launch(-5, 5),
        # a synchronous all-to-all enqueued on the compute stream itself
        k("ncclDevKernel_SendRecv", 900, 30, 7, 6), launch(880, 6),
    ]
    g = idle_gaps({"traceEvents": events}, step_s=1000e-6)
    assert g["compute_stream"] == str((0, 7)) and g["gaps"] == 2
    assert g["host_s"] == pytest.approx(60e-6) and g["wait_s"] == pytest.approx(200e-6)
    assert g["host"][0]["cause"] == "Optimizer.step#AdamW.step > aten::_foreach_mul_"
    assert g["wait"][0]["cause"].startswith("[comm] ncclDevKernel_SendRecv")
    assert g["busy_s"] == pytest.approx(670e-6) and g["edge_s"] == pytest.approx(70e-6)
    assert g["comm_on_compute_s"] == pytest.approx(30e-6) and g["comm_on_compute"][0]["cause"] == "ncclDevKernel_SendRecv"
    assert "host 0.000 s" in format_gaps(g)


def test_where_the_step_goes_splits_kernels_and_charges_waits_to_communication():
    """profile_summary.where_the_step_goes (Note [Where the step goes]): kernel time by part over every stream
    (attention split into forward / backward, Liger / Inductor kernels apart from ATen's element-wise), and the
    compute stream's idle time, the part spent waiting on a collective counted as exposed communication."""
    from profile_summary import part, where_the_step_goes

    assert part("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26") == "attention backward"
    assert part("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7") == "attention forward"
    assert part("kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90") == "attention backward"
    assert part("triton_poi_fused__unsafe_view_mul_silu_2") == "fused (Liger / Inductor)"
    assert part("_rms_norm_backward_kernel") == "fused (Liger / Inductor)"
    assert part("void at::native::unrolled_elementwise_kernel<at::native::CUDAFunctor_add<float>>") == "element-wise & reductions (ATen)"
    assert part("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>") == "optimizer"
    assert part("Memcpy DtoD (Device -> Device)") == "copy" and part("ncclDevKernel_SendRecv") == "comm"

    def k(name, ts, dur, stream, cat="kernel"):
        return dict(ph="X", cat=cat, name=name, pid=0, tid=stream, ts=ts, dur=dur, args=dict(stream=stream, correlation=ts))

    events = [k("cudnn_sdpa_flash_fprop", 0, 300, 7), k("nvjet_tst_192x192", 300, 200, 7),
              k("ncclDevKernel_SendRecv", 400, 250, 20),  # overlaps the gemm by 100 us, then the compute stream waits 150 us
              k("cudnn_sdpa_flash_bprop", 650, 600, 7), k("triton_poi_fused_mul_silu", 1250, 50, 7),
              k("Memcpy DtoD (Device -> Device)", 1300, 20, 7, cat="gpu_memcpy")]
    w = where_the_step_goes({"traceEvents": events}, step_s=1400e-6)
    assert w["parts_s"]["attention forward"] == pytest.approx(300e-6) and w["parts_s"]["attention backward"] == pytest.approx(600e-6)
    assert w["parts_s"]["gemm"] == pytest.approx(200e-6) and w["parts_s"]["comm"] == pytest.approx(250e-6)
    assert w["parts_s"]["fused (Liger / Inductor)"] == pytest.approx(50e-6) and w["parts_s"]["copy"] == pytest.approx(20e-6)
    assert w["comm_s"]["waited_on_comm"] == pytest.approx(150e-6) and w["idle_s"]["wait"] == pytest.approx(150e-6)
    assert w["busy_s"] == pytest.approx(1170e-6) and w["idle_s"]["edge"] == pytest.approx(80e-6)
    assert w["calls"]["attention forward"] == 1 and w["top_waits"][0]["cause"].startswith("[comm] ncclDevKernel_SendRecv")
    assert w["top_kernels"] == {"copy": [dict(name="Memcpy DtoD (Device -> Device)", seconds=pytest.approx(20e-6), calls=1)]}


def _attn(system, algorithm, tflops, peak, heads="32/8", gpus=4, seq=1048576, chunks=1, error=None):
    return dict(bench="attention", system=system, algorithm=algorithm, heads=heads, seq=seq, gpus=gpus, backend="cudnn",
                head_chunks=chunks, tflops_per_gpu=tflops, peak_mem_gb=peak, error=error)


def test_attention_grid_table(tmp_path):
    from benchmarks import report

    grid_tables = lambda paths, seqs=None: report.attention_grid(report.load(paths), seqs)  # noqa: E731
    old, new = tmp_path / "20261121.json", tmp_path / "20261122.json"
    old.write_text(json.dumps([_attn("seqpar", "ring", 400.0, 9.0), _attn("single", "cudnn", 500.0, 70.0, gpus=1)]))
    new.write_text(json.dumps([
        _attn("seqpar", "ring", 510.0, 20.0),  # the later record of the same point wins over 400.0
        _attn("seqpar", "ring", 505.0, 12.0, chunks=4),  # another head-chunk count: the faster one is shown
        _attn("seqpar", "allgather", 520.0, 25.0, chunks=4),
        _attn("torch_cp", "allgather", 480.0, 40.0),
        _attn("torch_cp", "alltoall", None, None, error="OutOfMemoryError: CUDA out of memory"),
        _attn("seqpar", "ring", 490.0, 30.0, heads="33/33", chunks=3),
        _attn("torch_cp", "allgather", 500.0, 90.0, heads="33/33"),
        _attn("seqpar", "ring", 1.0, 1.0, seq=131072),  # filtered out by seqs
        dict(_attn("seqpar", "ulysses", 700.0, 1.0), backend="fa4"),  # another kernel: not in the cuDNN grid
    ]))
    table = grid_tables([str(new), str(old)], [1048576])
    lines = table.splitlines()
    assert lines[0] == "4 GPUs, S = 1024K (TFLOP/s/GPU / peak GB):" and "131072" not in table and "128K" not in table
    assert lines[2] == ("| heads | one GPU | ring | all-gather | torch CP allgather | torch CP alltoall | ours / torch CP | ours / one GPU |")
    # rows: 32/8 before 33/33 (by query heads); the best of ours bold; ratios to the best torch CP and one GPU
    assert lines[4] == "| 32/8 | 500.0 / 70.0 | 510.0 / 20.0 | **520.0 / 25.0 c4** | 480.0 / 40.0 | OOM | 1.083 | 1.040 |"
    assert lines[5] == "| 33/33 | - | **490.0 / 30.0 c3** | - | 500.0 / 90.0 | - | 0.980 | - |"
    # a head-parallel system that cannot split the heads reads "(33 heads)", measured or not
    new.write_text(json.dumps([_attn("seqpar", "ulysses", 500.0, 5.0), _attn("seqpar", "ring", 490.0, 30.0, heads="33/33")]))
    assert "| 33/33 | - | **490.0 / 30.0** | (33 heads) |" in grid_tables([str(new)])
    # eight GPUs: the 2D splits and the double ring of 4 get columns, in hp order; 2D 4x2 cannot split 33 heads
    new.write_text(json.dumps([_attn("seqpar", "ring", 450.0, 9.0, gpus=8), _attn("seqpar", "2d:4x2", 470.0, 8.0, gpus=8),
                               _attn("seqpar", "2d:8x1", 480.0, 7.0, gpus=8), _attn("seqpar", "ring:inner4", 440.0, 9.5, gpus=8),
                               _attn("seqpar", "ring", 430.0, 9.0, gpus=8, heads="33/33")]))
    lines = grid_tables([str(new)]).splitlines()
    assert lines[0] == "8 GPUs, S = 1024K (TFLOP/s/GPU / peak GB):"
    assert lines[2] == "| heads | one GPU | ring | 2D 8x1 | 2D 4x2 | double ring (4) | ours / torch CP | ours / one GPU |"
    assert lines[4] == "| 32/8 | - | 450.0 / 9.0 | **480.0 / 7.0** | 470.0 / 8.0 | 440.0 / 9.5 | - | - |"
    assert lines[5] == "| 33/33 | - | **430.0 / 9.0** | (33 heads) | (33 heads) | - | - | - |"


def test_longest_per_config_keeps_the_longest_that_trained():
    from benchmarks import report

    def rec(system, seq, *statuses, gpus=4):
        return dict(bench="longest", system=system, model="llama-7b", gpus=gpus, device="H200", seq=seq,
                    attempts=[dict(seq=1, status=s) for s in statuses])

    rows = [
        rec("seqpar", 393216, "ok", gpus=2), rec("seqpar", None, "skipped", gpus=2),  # tried nothing: ignored
        rec("seqpar", None, "oom"), rec("seqpar", 786432, "ok"), rec("seqpar", None, "oom"),  # a later OOM at 1M
        rec("torch_cp", None, "oom", "oom"),  # nothing trained: kept as "none fit"
    ]
    got = {(r["system"], r["gpus"]): r["seq"] for r in report.longest_per_config(rows)}
    assert got == {("seqpar", 2): 393216, ("seqpar", 4): 786432, ("torch_cp", 4): None}


def test_oom_state_names_where_and_memory():
    import driver

    def kernel_call():
        raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")

    try:
        kernel_call()
    except RuntimeError as exc:
        assert driver.is_oom(exc)
        state = driver.oom_state(exc)
    where = state.split("; at ", 1)[1]
    assert where.startswith("test_benchmarks_cpu.py:") and " kernel_call <- " in where, state
    assert state.startswith("no CUDA" if not torch.cuda.is_available() else "allocated "), state


def test_train_plot_leaves_out_offload_params_runs(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import plot

    offloaded = _record(seq=65536, offload_params=True, tag="offload-params-auto")
    assert plot.plot_train(plt, [offloaded], str(tmp_path)) is None
    assert plot.plot_train(plt, [offloaded, _record()], str(tmp_path)).endswith("train.png")


def test_context_extension_demonstration_runs_end_to_end(tmp_path):
    """benchmarks/extend.py --tiny (issue #40's demonstration at toy size): trains, evaluates (a) unchanged and (b)
    after YaRN to 4L and a fine-tune at 4L, and writes each evaluation's numbers and figures and the summary."""
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    import extend

    extend.main(["--tiny", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["overrides"]["rope_parameters"]["rope_type"] == "yarn"
    assert summary["overrides"]["max_position_embeddings"] == 4 * summary["seq"]
    for phase in ("a_unchanged", "b_yarn_finetuned"):
        accuracy = summary["accuracy_by_length"][phase]
        assert sorted(map(int, accuracy)) == [summary["seq"] // 2, summary["seq"], 2 * summary["seq"], 4 * summary["seq"]]
        assert all(0.0 <= a <= 1.0 for a in accuracy.values())
    for files in summary["files"].values():
        assert {os.path.splitext(f)[1] for f in files} == {".json", ".png"} and all(os.path.exists(f) for f in files)


def test_the_frontier_table_sets_ours_beside_alsts_recipe():
    """frontier-one-gpu: ours (bf16-mixed) against ALST's offload recipe on the same device and length, with the
    speed ratio, reserved / allocated GPU memory and host peak; other one-GPU runs stay in finetune-one-gpu."""
    from benchmarks import report

    base = dict(model="hf-llama-3-8b-shaped", seq=131072, device="NVIDIA H200", commit="abc1234", date="2026-11-28")
    ours = dict(base, bench="memory_plan", system="seqpar", precision="bf16-mixed", tokens_per_s=3000.0, peak_reserved_gb=110.0,
                peak_mem_gb=100.0, host_maxrss_gb=130.0, plan={"offload_params": True, "head_chunks": 1})
    alst = dict(base, bench="alst", system="alst", recipe="ArcticTraining run-h200-sp1-llama-8b-liger-offload-tiled-mlp.yml",
                tokens_per_s=1500.0, peak_reserved_gb=120.0, peak_mem_gb=50.0, host_maxrss_gb=250.0, optimizer="DeepSpeedCPUAdam",
                liger="rope, rms_norm, swiglu", attention="sdpa", deepspeed="0.19.8")
    pieces = dict(base, bench="alst", system="alst", recipe="TiledMLP+TiledFusedLogitsLoss", tokens_per_s=1.0, peak_mem_gb=1.0)
    lines = report.frontier_table([ours, alst, pieces]).splitlines()
    assert len(lines) == 4, lines
    assert "| **ours** | memory=\"auto\": offload_params | fp32 | 3,000 | 2.00x | 110.0 | 100.0 | 130.0 |" in lines[2]
    assert "ALST's recipe (DeepSpeed 0.19.8)" in lines[3] and "| 1,500 | · | 120.0 | 50.0 | 250.0 |" in lines[3]
    finetune = report.finetune_table([ours, alst, pieces])
    assert "3,000" not in finetune and "1,500" not in finetune and len(finetune.splitlines()) == 3  # only the pieces run


def test_the_frontier_tables_keep_fewer_layer_runs_apart_and_show_a_host_out_of_memory():
    """frontier-one-gpu: full depth only, S in order (256K after 128K), "vs ALST" within one (device, model, S), and a run
    the host-memory watchdog ended reads "host out of memory" (also in finetune-one-gpu); frontier-layers: the runs of
    fewer layers, with the memory a layer adds and the planner's full-depth estimate."""
    from benchmarks import report

    base = dict(model="hf-llama-3-8b-shaped", device="NVIDIA H200", commit="abc1234", _file="20261201-nvidia-h200-x2.json")
    ours = dict(base, bench="memory_plan", system="seqpar", precision="bf16-mixed", plan={"offload_params": True})
    alst = dict(base, bench="alst", system="alst", recipe="ArcticTraining run-h200-sp1", deepspeed="0.19.8")
    oom = "host out of memory: MemAvailable 7.9 GB of 270.0 GB at process RSS 255.0 GB (peak RSS 256.1 GB)"
    rows = [dict(ours, seq=262144, tokens_per_s=1400.0, peak_mem_gb=127.0), dict(alst, seq=262144, error=oom, host_oom=True),
            dict(ours, seq=131072, tokens_per_s=3000.0, peak_mem_gb=100.0), dict(alst, seq=131072, tokens_per_s=1500.0),
            dict(ours, model="hf-llama-3-8b-shaped-4-layers", seq=1048576, layers=4, tokens_per_s=900.0, peak_mem_gb=60.0,
                 peak_reserved_gb=62.0, host_maxrss_gb=150.0, kept_bytes_per_token_per_layer=8192.0, estimate_gb=61.0,
                 estimate_host_gb=140.0, full_depth_layers=32, full_depth_estimate_gb=130.0, full_depth_estimate_host_gb=240.0,
                 full_depth_fits={"device": True, "host": False}, full_depth_refusal="...", full_depth_longest_seq=786432),
            dict(alst, model="hf-llama-3-8b-shaped-4-layers", seq=1048576, layers=4, full_depth_layers=32, tokens_per_s=500.0,
                 peak_mem_gb=30.0, full_depth_zero_host_gb_estimate=144.5, full_depth_offload_host_gb_estimate=260.0,
                 host_memory_gb=270.0),
            dict(alst, model="hf-llama-3-8b-shaped-2-layers", seq=1048576, layers=2, full_depth_layers=32, tokens_per_s=800.0,
                 peak_mem_gb=20.0)]
    lines = report.frontier_table(rows).splitlines()[2:]
    assert [x.split(" | ")[1] for x in lines] == ["128K", "128K", "256K", "256K"], lines
    assert "| 3,000 | 2.00x |" in lines[0] and "| 1,400 | · |" in lines[2] and "| host out of memory | · |" in lines[3]
    assert "layers" not in report.frontier_table(rows) and "1M" not in report.frontier_table(rows)
    finetune = report.finetune_table([dict(alst, recipe="TiledMLP", seq=262144, error=oom)])
    assert "| host out of memory |" in finetune
    layers = report.frontier_layers_table(rows).splitlines()
    assert len(layers) == 5 and all("| llama-3-8b-shaped |" in x for x in layers[2:]), layers
    ours_row = next(x for x in layers if "**ours**" in x)
    assert "| 4 of 32 | 1M | **ours** | 900 | 62.0 | 60.0 | 150.0 | 8.59 (kept) | 61.0 / 140.0 | 130.0 / 240.0 |" in ours_row
    assert "device yes, host no; planner refuses (longest 768K)" in ours_row
    alst4 = next(x for x in layers if "| 4 of 32 |" in x and "ALST" in x)
    assert "| 5.00 (two depths) |" in alst4 and "| · / 404.5 | host no (of 270) |" in alst4  # (30 - 20) / (4 - 2) GB a layer
    assert [x.split(" | ")[1] for x in layers[2:]] == ["2 of 32", "4 of 32", "4 of 32"]


def test_memory_layers_records_the_full_depth_estimate(tmp_path, monkeypatch):
    """hf.py memory --layers N (Note [The longest by memory]): the model's width with N layers (the record's ``layers``
    and a ``-N-layers`` name), and the planner's estimate for the full depth with the options the N-layer run planned
    (here planned on the CPU for a device of 150 GB), larger than the N-layer one; the same inputs give the strategy's
    own N-layer estimate."""
    import dataclasses

    import hf

    from lightning_seqpar import SequenceParallelStrategy
    from lightning_seqpar.planner.memory import MemoryOptions

    monkeypatch.setattr(SequenceParallelStrategy, "_device_memory_bytes", lambda self, device: int(150e9))
    out = tmp_path / "memory.json"
    hf.main(["memory", "--model", "tiny", "--seqs", "64", "--layers", "1", "--steps", "1", "--out", str(out)])
    (row,) = json.loads(out.read_text())
    assert row["model"] == "hf-tiny-shaped-1-layers" and row["layers"] == 1 and "error" not in row, row
    assert row["full_depth_layers"] == hf.MEMORY_SHAPES["tiny"]["num_hidden_layers"] == 2 and row["full_depth_inputs_match"] is True
    assert row["full_depth_estimate_allocated_gb"] > row["estimate_allocated_gb"] and row["full_depth_estimate_gb"] > row["estimate_gb"]
    assert row["full_depth_fits"] == {"device": True, "host": True} and isinstance(row["full_depth_plan"], dict)
    ran = {**dataclasses.asdict(MemoryOptions()), **row["full_depth_options"]}  # the N-layer run's options, in full
    assert {k: ran[k] for k in row["plan"]} == row["plan"]
    assert row["kept_bytes_per_token_per_layer"] is not None and row["full_depth_estimate_host_gb"] == 0.0


def test_the_all_to_all_benchmark_measures_alone_and_beside_a_load(tmp_path):
    """``benchmarks/attention.py a2a`` on two gloo ranks: one record per size with the all-to-all's time and GB/s leaving
    each rank, the load's time alone, both at once, the share hidden, and the NCCL_* environment it ran under."""
    import subprocess

    out = tmp_path / "a2a.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", os.path.join(BENCHMARKS, "attention.py"),
           "a2a", "--device", "cpu", "--mbs", "0.5,1", "--load", "attention", "--load-seq", "64", "--load-heads", "2/1",
           "--iters", "2", "--warmup", "1", "--out", str(out)]
    env = dict(os.environ, NCCL_DEBUG="WARN", OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["mb_per_rank"] for r in rows] == [0.5, 1.0]
    for r in rows:
        assert r["bench"] == "a2a" and r["gpus"] == 2 and r["load"] == "attention" and r["nccl_env"] == {"NCCL_DEBUG": "WARN"}
        assert r["a2a_ms"] > 0 and r["load_ms"] > 0 and r["both_ms"] > 0
        assert r["path"] == "kernel" and r["exact"] is True  # each rank's chunks arrived from the rank they name
        # from the rounded fields: the same figures up to their rounding
        assert r["gb_per_s_out"] == pytest.approx(r["mb_per_rank"] * 1e6 / 2 / (r["a2a_ms"] / 1e3) / 1e9, rel=0.01, abs=0.1)
        assert r["hidden"] == pytest.approx((r["load_ms"] + r["a2a_ms"] - r["both_ms"]) / r["a2a_ms"], abs=0.01)


def test_the_peaks_allocations_are_summed_by_where_they_were_made():
    """benchmarks/memory_peak.py replays one step's allocator events: the live set at the highest sum (bytes from
    before the recording counted, and taken off when the step frees them), by the innermost package frame and by op."""
    from benchmarks.memory_peak import peak_allocations

    def frames(op, place):
        return [{"filename": "/x/torch/functional.py", "line": 1, "name": op},
                {"filename": f"/y/lightning_seqpar/{place}", "line": 7, "name": "forward"}]

    G = 10**7  # sizes in hundredths of a GB: the summary rounds to MB
    trace = [
        {"action": "alloc", "addr": 1, "size": 100 * G, "frames": frames("mm", "models/llama.py")},
        {"action": "alloc", "addr": 2, "size": 50 * G, "frames": frames("empty", "attention/ulysses.py")},
        {"action": "segment_alloc", "addr": 0, "size": 4096},  # not an allocation the counters see
        {"action": "free_requested", "addr": 9, "size": 30 * G},  # allocated before the step
        {"action": "alloc", "addr": 3, "size": 70 * G, "frames": frames("mm", "models/llama.py")},  # the peak: 1000+100+50-30+70
        {"action": "free_requested", "addr": 1, "size": 100 * G},
        {"action": "free_completed", "addr": 1, "size": 100 * G},
        {"action": "alloc", "addr": 4, "size": 60 * G, "frames": [{"filename": "/x/torch/nn.py", "line": 2, "name": "gelu"}]},
    ]
    s = peak_allocations(trace, before=1000 * G)
    assert s["peak_bytes"] == 1190 * G and s["peak_gb"] == 11.9 and s["peak_event"] == 4 and s["events"] == len(trace)
    assert s["before_freed_gb"] == 0.3 and s["in_step_gb"] == 2.2 and s["before_gb"] == 10.0
    assert [(r["where"], r["blocks"]) for r in s["by_place"]] == [("models/llama.py:7 forward", 2), ("attention/ulysses.py:7 forward", 1)]
    assert s["by_place"][0]["gb"] == 1.7
    assert {r["where"] for r in s["by_op"]} == {"torch/functional.py:1 mm", "torch/functional.py:1 empty"}
    alone = peak_allocations([{"action": "free_requested", "addr": 5, "size": G}], before=10 * G)
    assert alone["peak_bytes"] == 10 * G and alone["peak_event"] is None and alone["by_place"] == [] and alone["in_step_gb"] == 0
