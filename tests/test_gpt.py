"""LSS GPT: shapes and configs, sequence-distributed position embeddings, fused communication,
and 5-step training parity under dp x sp (LSS Transformer: Wang et al.,
arXiv:2311.02382, §3-§5).

Distributed checks run on pooled gloo ranks (W = 2 and 4) against the same model on the full
sequence on one device, fp32, at the project's tolerance (atol 2e-6 / rtol 1e-5 for one step,
rtol 1e-5 on losses and atol 1e-5 on weights after 5 AdamW steps).
"""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_distributed

LAYOUTS = ("zigzag", "contiguous")
SMALL = dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, max_seq_len=64)  # D = 8
SEQ, BATCH = 32, 2  # zigzag over W = 4: 8 chunks of 4 tokens
ATOL, RTOL = 2e-6, 1e-5
TIMEOUT = 120


def _gpt(seed: int = 0, **overrides):
    from lightning_seqpar.models import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**SMALL, **overrides}))


def _batch(seed: int = 1, batch: int = BATCH, seq: int = SEQ, vocab: int = SMALL["vocab_size"]) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": torch.arange(seq).expand(batch, seq)}


# ----------------------------------------------------------------------------------------------- one process


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-tiny-mqa"])
@pytest.mark.parametrize("tie", [True, False])
def test_forward_backward_shapes(name, tie):
    from lightning_seqpar.models import GPT, GPTConfig

    config = GPTConfig.from_name(name, tie_embeddings=tie)
    model = GPT(config)
    ids = torch.randint(0, config.vocab_size, (2, 24))
    logits = model(ids)
    assert logits.shape == (2, 24, config.vocab_size)
    hidden = model(ids, torch.arange(24)[None], output="hidden")  # (1, S) positions broadcast
    assert hidden.shape == (2, 24, config.n_embd)
    torch.testing.assert_close(model.lm_head(hidden), logits, rtol=0, atol=0)
    F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    assert (model.lm_head.weight is model.wte.weight) == tie
    assert model.num_params() == config.num_params()
    assert model.num_params(non_embedding=True) == config.num_params(non_embedding=True)
    assert len(model.layers) == config.n_layer


def _naive_gpt(model, ids: torch.Tensor) -> torch.Tensor:
    """nanoGPT's forward written out with the model's weights (repeat K/V heads, SDPA causal)."""
    c = model.config
    B, S = ids.shape
    x = model.wte.weight[ids] + model.wpe.weight[:S]
    for blk in model.layers:
        h = F.layer_norm(x, (c.n_embd,), blk.ln_1.weight, blk.ln_1.bias, c.norm_eps)
        q = (h @ blk.attn.q_proj.weight.T + blk.attn.q_proj.bias).view(B, S, c.n_head, c.head_dim)
        k, v = (h @ blk.attn.kv_proj.weight.T + blk.attn.kv_proj.bias).view(B, S, 2, c.n_kv_head, c.head_dim).unbind(2)
        rep = c.n_head // c.n_kv_head
        k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + blk.attn.o_proj(y.transpose(1, 2).reshape(B, S, -1))
        h = F.layer_norm(x, (c.n_embd,), blk.ln_2.weight, blk.ln_2.bias, c.norm_eps)
        x = x + blk.mlp.c_proj(F.gelu(blk.mlp.c_fc(h)))
    x = F.layer_norm(x, (c.n_embd,), model.ln_f.weight, model.ln_f.bias, c.norm_eps)
    return x @ model.wte.weight.T


@pytest.mark.parametrize("n_kv_head", [4, 1])
def test_matches_nanogpt_forward(n_kv_head):
    model = _gpt(n_kv_head=n_kv_head)
    ids = _batch()["input_ids"]
    torch.testing.assert_close(model(ids), _naive_gpt(model, ids), atol=ATOL, rtol=RTOL)


def test_named_configs_follow_the_paper():
    from lightning_seqpar.models import GPT_CONFIGS, GPTConfig

    small = GPTConfig.from_name("lss-gpt-small")  # §5.2: 512 wide, 6 layers, 8 heads, ~20M, enwik8 bytes
    assert (small.n_embd, small.n_layer, small.n_head, small.vocab_size) == (512, 6, 8, 256)
    assert 19.5e6 < small.num_params() < 20.5e6
    assert small.max_seq_len % 348 == 0  # a Table 3 length (58 tokens per GPU)
    large = GPTConfig.from_name("lss-gpt-1.5b")  # §5.3: 2048 wide, 24 layers, 16 heads
    assert (large.n_embd, large.n_layer, large.n_head) == (2048, 24, 16)
    assert 1.2e9 < large.num_params() < 1.22e9  # the paper's shape gives 1.21B, not 1.5B (Note [Named configurations])
    assert large.max_seq_len >= 1512  # Table 6
    assert {"gpt-tiny", "gpt-tiny-mqa"} <= set(GPT_CONFIGS)
    assert GPTConfig.from_name("gpt-tiny", dropout=0.1).dropout == 0.1
    assert GPTConfig().dropout == 0.0 and GPTConfig().kv_comm == "auto"
    # 6N + 6 L S H D, with the tied head's matmul counted
    c = GPTConfig.from_name("gpt-tiny")
    assert c.flops_per_token(128) == 6 * (c.num_params(non_embedding=True) + 256 * 64) + 6 * 2 * 128 * 64


def test_dropout_only_in_training():
    model = _gpt(dropout=0.5)
    ids = _batch()["input_ids"]
    model.eval()
    torch.testing.assert_close(model(ids), model(ids), rtol=0, atol=0)
    model.train()
    assert not torch.equal(model(ids), model(ids))


@pytest.mark.parametrize(
    "overrides,named",
    [
        (dict(n_head=5), "n_embd"),
        (dict(n_kv_head=3), "n_kv_head"),
        (dict(dropout=1.0), "dropout"),
        (dict(kv_comm="qkv"), "kv_comm"),
        (dict(max_seq_len=0), "max_seq_len"),
    ],
)
def test_config_errors_name_the_field(overrides, named):
    from lightning_seqpar.models import GPTConfig

    with pytest.raises(ValueError, match=named):
        GPTConfig(**{**SMALL, **overrides})
    with pytest.raises(ValueError, match="lss-gpt-small"):
        GPTConfig.from_name("lss-gpt-smal")


def test_forward_errors():
    model = _gpt()
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(ids, torch.arange(60, 68)[None])  # global positions beyond the 64-row table
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="position_ids"):
        model(ids, torch.arange(4)[None])
    with pytest.raises(ValueError, match="output"):
        model(ids, output="loss")


def test_kv_comm_resolution():
    """"auto" gathers whichever is smaller per token under all-gather attention: x (d) or K, V (2 H_kv D)."""
    from lightning_seqpar.attention.fused import resolve_kv_comm

    def mode(kv_comm, algorithm, n_kv_head):
        return resolve_kv_comm(kv_comm, algorithm=algorithm, n_embd=32, n_kv_head=n_kv_head, head_dim=8)

    assert mode("auto", "allgather", 4) == "input"  # MHA: d = 32 < 2 * 4 * 8 = 64
    assert mode("auto", "allgather", 2) == "kv"  # GQA: 2 * 2 * 8 = 32, not smaller than d: keep K/V
    assert mode("auto", "allgather", 1) == "kv"  # MQA: 16 < 32
    assert mode("auto", "ring", 4) == "kv"  # the ring does not gather the sequence: nothing to fuse
    assert mode("auto", "ulysses", 4) == "kv"
    assert mode("input", "ring", 1) == "input"  # explicit choice wins on a 1-D mesh
    assert mode("kv", "allgather", 4) == "kv"
    assert all(mode(c, None, 4) == "local" for c in ("auto", "kv", "input"))
    with pytest.raises(ValueError, match="kv_comm='input'.*'2d'"):
        mode("input", "2d", 4)
    with pytest.raises(ValueError, match="kv_comm"):
        mode("fused", "allgather", 4)


def test_apply_attention_reaches_the_fused_module():
    """``apply_attention`` configures the ``Attention`` inside every ``FusedKVAttention``; None is local."""
    from lightning_seqpar.attention import Attention
    from lightning_seqpar.parallel.parallelize import apply_attention

    model = _gpt()
    cores = [m for m in model.modules() if isinstance(m, Attention)]
    assert cores == [block.attn.attn_core.core for block in model.layers]
    assert apply_attention(model, None, attention="allgather") == SMALL["n_layer"]
    assert {block.attn.attn_core.mode() for block in model.layers} == {"local"}


def test_model_file_imports_nothing_from_torch_distributed():
    import lightning_seqpar.models.gpt as gpt

    tree = ast.parse(Path(gpt.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n and n.startswith("torch.distributed")]


# ----------------------------------------------------------------------------------------------- distributed helpers


def _mesh_1d(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))


def _reference_step(model, batch) -> torch.Tensor:
    """Single-device mean cross entropy over every token of ``batch``, with its backward."""
    logits = model(batch["input_ids"], batch["position_ids"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    loss.backward()
    return logits.detach()


def _sharded_step(model, batch, mesh, layout: str, *, per_segment_mean: bool = False):
    """This rank's shard of ``batch`` through ``model``; loss normalised by the GLOBAL token count
    (``per_segment_mean``: by the local count, the paper's per-segment mean). Returns (logits, shard positions)."""
    from lightning_seqpar.loss import global_mean_loss, token_cross_entropy_sum
    from lightning_seqpar.sharding import shard_sequence

    local = {k: shard_sequence(v, mesh, dim=1, layout=layout) for k, v in batch.items()}
    logits = model(local["input_ids"], local["position_ids"])
    loss_sum, n_valid = token_cross_entropy_sum(logits, local["labels"])
    loss = loss_sum / n_valid if per_segment_mean else global_mean_loss(loss_sum, n_valid, mesh.get_group())
    loss.backward()
    return logits.detach(), local["position_ids"][0]


def _summed_grads(model) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        grads[name] = g
    return grads


def _distributed(model, mesh, layout: str, algorithm: str = "allgather", **config):
    from lightning_seqpar.models import GPT, GPTConfig
    from lightning_seqpar.parallel.parallelize import apply_attention

    twin = GPT(GPTConfig(**{**vars(model.config), **config}))
    twin.load_state_dict(model.state_dict())
    assert apply_attention(twin, mesh, attention=algorithm, layout=layout) == twin.config.n_layer
    return twin


# ----------------------------------------------------------------------------------------------- position embeddings


def _position_embedding_worker(rank: int, world: int) -> None:
    from lightning_seqpar.sharding import shard_sequence

    mesh = _mesh_1d(world)
    batch = _batch()
    reference = _gpt()
    _reference_step(reference, batch)
    ref = {n: p.grad for n, p in reference.named_parameters()}
    for layout in LAYOUTS:
        for kv_comm in ("input", "kv"):
            label = f"W={world} {layout} kv_comm={kv_comm} rank={rank}"
            model = _distributed(reference, mesh, layout, kv_comm=kv_comm)
            _, positions = _sharded_step(model, batch, mesh, layout)
            local = model.wpe.weight.grad.clone()
            # Principle 2: only the rows of this rank's global positions get gradient.
            own = torch.zeros(SMALL["max_seq_len"], dtype=torch.bool)
            own[positions] = True
            assert torch.equal(positions, shard_sequence(torch.arange(SEQ), mesh, dim=0, layout=layout)), label
            assert local[own].abs().amin(dim=1).gt(0).all(), label
            assert torch.equal(local[~own], torch.zeros_like(local[~own])), label
            summed = _summed_grads(model)
            # Summing over SP concatenates row blocks: each row comes from its one owner, bit for bit.
            assert torch.equal(summed["wpe.weight"][own], local[own]), label
            for name, g in summed.items():  # global normalisation + SUM: the single-device gradient
                torch.testing.assert_close(g, ref[name], atol=ATOL, rtol=RTOL, msg=lambda m: f"{label} {name}: {m}")
            # The naive way: averaging the table's gradient over the SP group divides it by W.
            averaged = summed["wpe.weight"] / world
            assert not torch.allclose(averaged, ref["wpe.weight"], atol=ATOL, rtol=RTOL), label
            torch.testing.assert_close(averaged * world, ref["wpe.weight"], atol=ATOL, rtol=RTOL)

        # The paper's per-segment mean loss: the SP average is right for the shared parameters, and
        # the table's rows, each with one owner, then carry a factor W (Note [Sequence-distributed
        # position embeddings]).
        model = _distributed(reference, mesh, layout, kv_comm="input")
        _sharded_step(model, batch, mesh, layout, per_segment_mean=True)
        summed = _summed_grads(model)
        for name, g in summed.items():
            expected = ref[name] * world if name == "wpe.weight" else ref[name]
            torch.testing.assert_close(g / world if name != "wpe.weight" else g, expected, atol=ATOL * world, rtol=RTOL,
                                       msg=lambda m: f"per-segment mean W={world} {layout} {name}: {m}")


@pytest.mark.parametrize("world", [2, 4])
def test_position_embedding_gradient_is_exact(world):
    run_distributed(_position_embedding_worker, world, timeout=TIMEOUT)


# ----------------------------------------------------------------------------------------------- fused communication


def _record_collectives():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in ("_c10d_functional", "c10d"):
                first = args[0]
                while not isinstance(first, torch.Tensor):  # c10d.allgather_ takes a list of lists of tensors
                    first = first[0]
                self.calls.append((func.__name__.split(".")[0], first.numel()))
            return func(*args, **(kwargs or {}))

    return Recorder()


def _fused_worker(rank: int, world: int) -> None:
    from lightning_seqpar.sharding import shard_sequence

    mesh = _mesh_1d(world)
    batch = _batch()
    for n_kv_head in (4, 1):  # MHA and MQA
        reference = _gpt(n_kv_head=n_kv_head)
        ref_logits = _reference_step(reference, batch)
        ref = {n: p.grad for n, p in reference.named_parameters()}
        for layout in LAYOUTS:
            expected_logits = shard_sequence(ref_logits, mesh, dim=1, layout=layout)
            results = {}
            for algorithm, kv_comm in (("allgather", "input"), ("allgather", "kv"), ("ring", "kv"), ("ulysses", "kv"),
                                       ("allgather", "auto")):
                label = f"W={world} H_kv={n_kv_head} {layout} {algorithm} kv_comm={kv_comm} rank={rank}"
                model = _distributed(reference, mesh, layout, algorithm, kv_comm=kv_comm)
                mode = model.layers[0].attn.attn_core.mode()
                assert mode == ("input" if kv_comm == "input" or (kv_comm == "auto" and n_kv_head == 4) else "kv"), label
                recorder = _record_collectives()
                with recorder:
                    logits, _ = _sharded_step(model, batch, mesh, layout)
                if mode == "input":  # per layer: one all-gather of x forward, one reduce-scatter of dx backward
                    x_shard = BATCH * (SEQ // world) * SMALL["n_embd"]
                    gathers = [c for c in recorder.calls if c[0].startswith("all_gather")]
                    scatters = [c for c in recorder.calls if c[0].startswith("reduce_scatter")]
                    assert gathers == [(gathers[0][0], x_shard)] * SMALL["n_layer"], (label, recorder.calls)
                    assert len(scatters) == SMALL["n_layer"], (label, recorder.calls)
                grads = _summed_grads(model)
                torch.testing.assert_close(logits, expected_logits, atol=ATOL, rtol=RTOL, msg=lambda m: f"{label}: {m}")
                for name, g in grads.items():
                    torch.testing.assert_close(g, ref[name], atol=ATOL, rtol=RTOL, msg=lambda m: f"{label} {name}: {m}")
                results[(algorithm, kv_comm)] = logits, grads
            # fused and unfused all-gather: the same numbers (fp32, tighter than the reference tolerance)
            (fused_logits, fused), (kv_logits, kv) = results[("allgather", "input")], results[("allgather", "kv")]
            torch.testing.assert_close(fused_logits, kv_logits, atol=1e-6, rtol=1e-6)
            for name in fused:
                torch.testing.assert_close(fused[name], kv[name], atol=1e-6, rtol=1e-6, msg=name)


@pytest.mark.parametrize("world", [2, 4])
def test_fused_and_unfused_match_single_device(world):
    run_distributed(_fused_worker, world, timeout=TIMEOUT)


def _input_with_2d_worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_seqpar.parallel.parallelize import apply_attention

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("hp", "cp"))
    model = _gpt(kv_comm="input")
    apply_attention(model, mesh, attention="2d", layout="zigzag")
    ids = torch.zeros(1, SEQ // world, dtype=torch.long)
    with pytest.raises(ValueError, match="kv_comm='input'"):
        model(ids, torch.arange(SEQ // world)[None])


def test_fused_input_refuses_2d_attention():
    run_distributed(_input_with_2d_worker, 4, timeout=TIMEOUT)


# ----------------------------------------------------------------------------------------------- training parity


STEPS, GLOBAL_BATCH, LR = 5, 4, 3e-3
TRAIN = dict(SMALL, vocab_size=256)  # bytes


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, betas=(0.9, 0.95))


def _train_worker(rank: int, world: int, sp: int, path: str) -> None:
    """5 AdamW steps of the strategy's recipe written out: the 4-D mesh, Attention configured over
    the SP sub-mesh, FSDP2 over dp x sp with SUM gradient reduction, the global-mean loss."""
    import torch.distributed as dist
    from torch.utils.data import default_collate

    from lightning_seqpar.data import CharWindowDataset
    from lightning_seqpar.loss import global_mean_loss, token_cross_entropy_sum
    from lightning_seqpar.parallel.mesh import ParallelDims, dp_rank_and_size, fsdp_mesh, sp_mesh
    from lightning_seqpar.models import GPT, GPTConfig
    from lightning_seqpar.parallel.parallelize import apply_attention, apply_fsdp
    from lightning_seqpar.sharding import shard_sequence

    data = CharWindowDataset(path=path, seq_len=SEQ)
    steps = [default_collate([data[i] for i in range(s * GLOBAL_BATCH, (s + 1) * GLOBAL_BATCH)]) for s in range(STEPS)]

    torch.manual_seed(0)
    reference = GPT(GPTConfig(**TRAIN))
    initial = copy.deepcopy(reference.state_dict())
    optimizer = _adamw(reference)
    ref_losses = []
    for batch in steps:
        optimizer.zero_grad()
        logits = reference(batch["input_ids"], batch["position_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        optimizer.step()
        ref_losses.append(loss.item())

    mesh = ParallelDims.from_sizes(world_size=world, sequence_parallel_size=sp).build_mesh("cpu")
    dp_rank, dp = dp_rank_and_size(mesh)
    per_replica = GLOBAL_BATCH // dp
    for layout in LAYOUTS:
        for kv_comm in ("input", "kv"):
            label = f"dp={dp} sp={sp} {layout} kv_comm={kv_comm} rank={rank}"
            model = GPT(GPTConfig(**TRAIN, kv_comm=kv_comm))
            model.load_state_dict(initial)
            apply_attention(model, sp_mesh(mesh), attention="allgather", layout=layout)
            apply_fsdp(model, fsdp_mesh(mesh), gradient_reduction="sum")
            optimizer = _adamw(model)
            losses = []
            for batch in steps:
                mine = {k: v[dp_rank * per_replica : (dp_rank + 1) * per_replica] for k, v in batch.items()}
                local = {k: shard_sequence(v, sp_mesh(mesh), dim=1, layout=layout) for k, v in mine.items()}
                optimizer.zero_grad()
                loss_sum, n_valid = token_cross_entropy_sum(model(local["input_ids"], local["position_ids"]), local["labels"])
                loss = global_mean_loss(loss_sum, n_valid, mesh)
                loss.backward()
                optimizer.step()
                reported = loss.detach().clone()
                dist.all_reduce(reported)
                losses.append(reported.item())
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0,
                                       msg=lambda m: f"{label}: {m}")
            for name, p in model.named_parameters():
                torch.testing.assert_close(p.full_tensor(), reference.state_dict()[name], rtol=0, atol=1e-5,
                                           msg=lambda m: f"{label} {name}: {m}")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("chars") / "text.txt"
    words = ["sequence", "parallel", "attention", "the", "of", "<page>", "embedding", "GPU", "1,024", "&amp;"]
    g = torch.Generator().manual_seed(0)
    path.write_text(" ".join(words[i] for i in torch.randint(0, len(words), (400,), generator=g).tolist()))
    return str(path)


@pytest.mark.parametrize("world,sp", [(2, 2), (4, 2), (4, 4)], ids=["dp1-sp2", "dp2-sp2", "dp1-sp4"])
def test_training_parity(world, sp, text_file):
    run_distributed(_train_worker, world, sp, text_file, timeout=TIMEOUT)
