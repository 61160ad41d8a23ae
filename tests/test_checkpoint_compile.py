"""torch.compile of checkpointed blocks (Note [Checkpoints under torch.compile]): one graph, no break, the same
outputs and gradients as eager, packed documents included (issue #56).

Dynamo's graph is what these tests check, so they compile with ``backend="aot_eager"`` (AOTAutograd's forward /
backward split and the checkpoint partitioner, without Inductor's C++ builds): seconds on the CPU.
"""

from __future__ import annotations

import copy
import sys
import threading

import pytest
import torch
from torch import nn

from lightning_seqpar.models import Llama, LlamaConfig
from lightning_seqpar.models.llama import LlamaBlock, rope_freqs_cis
from lightning_seqpar.parallel.activation_checkpointing import HostOffload, checkpoint_block, compile_target, offloads
from lightning_seqpar.parallel.parallelize import apply_ac, apply_compile, apply_mlp_tiles, parallelize
from lightning_seqpar.sharding.documents import PackedDocuments, current_documents, packed_documents

BACKEND = {"backend": "aot_eager"}
B, S = 2, 16
# a batch with documents, one without, the same shapes again (the graph is reused), another document count
DOCUMENTS = ([[3, 13], [7, 9]], None, [[5, 11], [2, 14]], [[5, 5, 6], [2, 2, 12]])


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _breaks() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _docs(lengths) -> PackedDocuments | None:
    return None if lengths is None else PackedDocuments.from_lengths(lengths)


def _block_step(block: nn.Module, x0: torch.Tensor, freqs: torch.Tensor, documents, *, backward_in_thread: bool = False):
    """(out, dx, every parameter's gradient) of one forward and backward of ``block`` with ``documents``."""
    block.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    with packed_documents(documents):
        y = block(x, freqs)
    loss = (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum()
    if backward_in_thread:  # a GPU's autograd threads have no documents of their own (Note [Per-call state])
        thread = threading.Thread(target=loss.backward)
        thread.start()
        thread.join()
    else:
        loss.backward()
    return [y.detach(), x.grad] + [p.grad.clone() for p in block.parameters()]


def _assert_same(got, expected, what: str) -> None:
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, atol=2e-6, rtol=1e-5, msg=lambda m, i=i: f"{what}, tensor {i}: {m}")


def _count_attention_forwards(monkeypatch) -> dict[str, int]:
    """Count the attention op's forward computations (its eager implementation, which aot_eager's graphs call)."""
    import lightning_seqpar.attention.api as api

    calls = {"n": 0}
    forward = api._forward

    def counted(*args, **kwargs):
        calls["n"] += 1
        return forward(*args, **kwargs)

    monkeypatch.setattr(api, "_forward", counted)
    return calls


@pytest.mark.parametrize(("mode", "attention_forwards"), [(None, 1), ("selective++", 1), ("full", 2)])
def test_a_checkpointed_llama_block_compiles_with_no_graph_break(mode, attention_forwards, monkeypatch):
    """The block compiles into one graph per kind of batch (with documents / without / another document count) and
    gives eager's outputs and gradients, packed documents masked, the backward in this thread or another; the
    attention forward runs once per step under Selective Checkpoint++ (its output kept) and twice under full."""
    config = LlamaConfig.from_name("tiny")
    torch.manual_seed(0)
    plain = LlamaBlock(config)
    eager = plain if mode is None else checkpoint_block(copy.deepcopy(plain), mode)
    compiled = copy.deepcopy(eager)
    compiled.compile(**BACKEND)
    x0 = torch.randn(B, S, config.n_embd)
    freqs = rope_freqs_cis(torch.arange(S).expand(B, S), head_dim=config.head_dim, theta=config.rope_theta)
    calls = _count_attention_forwards(monkeypatch)
    for step, lengths in enumerate(DOCUMENTS):
        documents = _docs(lengths)
        expected = _block_step(eager, x0, freqs, documents)
        calls["n"] = 0
        got = _block_step(compiled, x0, freqs, documents, backward_in_thread=step == 2)
        _assert_same(got, expected, f"{mode} compiled vs eager, documents {lengths}")
        assert calls["n"] == attention_forwards, f"{mode}: the attention ran {calls['n']} times in one step"
    assert _breaks() == {}
    assert _graphs() <= 3  # documents, none, a dynamic document count: no graph per batch
    assert current_documents() is None


def test_a_compiled_block_reads_each_threads_documents():
    """Compiled with one thread's documents, the block run by a thread without any masks nothing (its guards are
    checked in the calling thread: Note [Per-call state])."""
    config = LlamaConfig.from_name("tiny")
    torch.manual_seed(0)
    block = checkpoint_block(LlamaBlock(config), "selective++")
    compiled = copy.deepcopy(block)
    compiled.compile(**BACKEND)
    x0 = torch.randn(B, S, config.n_embd)
    freqs = rope_freqs_cis(torch.arange(S).expand(B, S), head_dim=config.head_dim, theta=config.rope_theta)
    documents = _docs(DOCUMENTS[0])
    with packed_documents(documents):
        _block_step(compiled, x0, freqs, current_documents())  # traced with documents
        seen = {}
        thread = threading.Thread(target=lambda: seen.setdefault("out", _block_step(compiled, x0, freqs, current_documents())))
        thread.start()
        thread.join()
    _assert_same(seen["out"], _block_step(block, x0, freqs, None), "another thread, no documents")
    assert not torch.allclose(seen["out"][0], _block_step(block, x0, freqs, documents)[0])  # the documents do mask
    assert _breaks() == {}


def _model() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=64, n_embd=32, n_layer=3, n_head=4, n_kv_head=2, intermediate_size=80, max_seq_len=64))


def _model_step(model: nn.Module, ids: torch.Tensor, documents) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with packed_documents(documents):
        loss = model(ids).float().square().mean()
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(("mode", "mlp_chunk_size"), [("selective++", 5), ("full", None)])
def test_parallelize_compiles_checkpointed_and_offloaded_blocks(mode, mlp_chunk_size):
    """``parallelize(compile_kwargs=...)`` with ``offload_checkpoints`` (allowed with compile since issue #56): the
    offloaded block compiles inside its checkpoint, the others with theirs, the last one unwrapped; the tiled MLP and
    the checkpointed norms compile with them. The same loss and gradients as the eager model, no graph break, the
    block input offloaded."""
    plain = _model()
    model = copy.deepcopy(plain)
    parallelize(model, sp_mesh=None, fsdp_mesh=None, activation_checkpointing=mode, uncheckpointed_blocks=1,
                offload_checkpoints=1, mlp_chunk_size=mlp_chunk_size, compile_kwargs=BACKEND)
    blocks = list(model.layers)
    assert [offloads(b) for b in blocks] == [True, False, False]
    assert compile_target(blocks[0]) is blocks[0]._checkpoint_wrapped_module  # hooks stay eager around it
    assert [compile_target(b) is b for b in blocks] == [False, True, True]
    assert all(getattr(compile_target(b), "_compiled_call_impl", None) is not None for b in blocks)
    offload = blocks[0].checkpoint_fn.keywords["offload"]
    ids = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(1))
    for lengths in DOCUMENTS[:2]:
        documents = _docs(lengths)
        _assert_same(_model_step(model, ids, documents), _model_step(plain, ids, documents), f"{mode}, documents {lengths}")
    assert offload.packed_bytes == 2 * B * S * 32 * 4  # the first block's input, fp32, each step
    assert _breaks() == {}


def test_offload_with_compile_is_accepted_by_the_strategy_config():
    from lightning_seqpar.parallel.config import StrategyConfig

    assert StrategyConfig(offload_checkpoints=2, compile=True).offload_checkpoints == 2


def test_an_offloaded_block_compiled_outside_its_checkpoint_still_trains_exactly():
    """Compiling the wrapper of an offloaded block by hand (not through apply_compile) breaks Dynamo's graph at the
    saved-tensor hooks (why :func:`compile_target` exists) but stays exact: the block runs eagerly there."""
    config = LlamaConfig.from_name("tiny")
    torch.manual_seed(0)
    block = checkpoint_block(LlamaBlock(config), "selective++", offload=HostOffload())
    compiled = copy.deepcopy(block)
    compiled.compile(**BACKEND)
    x0 = torch.randn(B, S, config.n_embd)
    freqs = rope_freqs_cis(torch.arange(S).expand(B, S), head_dim=config.head_dim, theta=config.rope_theta)
    documents = _docs(DOCUMENTS[0])
    _assert_same(_block_step(compiled, x0, freqs, documents), _block_step(block, x0, freqs, documents), "compiled outside")
    assert any("saved_tensors_hooks" in reason for reason in _breaks())


@pytest.mark.skipif("transformers" not in sys.modules and __import__("importlib").util.find_spec("transformers") is None,
                    reason="needs transformers")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_transformers_llama_compiles_checkpointed_with_packed_documents(family):
    """A Hugging Face Llama (and Qwen3: the families compile="auto" compiles, Note [Compile by default]) with the
    package's attention (``apply_hf_attention``), blocks checkpointed with Selective Checkpoint++ and compiled: no graph
    break, one graph for its three layers (Note [One graph for every layer]: no recompile per ``layer_idx``), eager's
    logits and gradients with packed documents."""
    import torch._dynamo
    import transformers
    from hf_testing import tiny_config
    from torch._dynamo.utils import counters

    from lightning_seqpar.hf import apply_hf_attention

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    config = tiny_config(family, num_hidden_layers=3)
    plain = transformers.AutoModelForCausalLM.from_config(config).float()
    apply_hf_attention(plain)
    apply_ac(plain, "selective++")
    compiled = copy.deepcopy(plain)
    assert apply_compile(compiled, BACKEND) == 3
    ids = torch.randint(0, 97, (B, 32), generator=torch.Generator().manual_seed(1))
    documents = PackedDocuments.from_lengths([[10, 22], [16, 16]])

    def step(model):
        model.zero_grad(set_to_none=True)
        with packed_documents(documents):
            logits = model(input_ids=ids, position_ids=documents.position_ids(), use_cache=False).logits
        logits.float().square().mean().backward()
        return [logits.detach()] + [p.grad.clone() for p in model.parameters()]

    for _ in range(2):
        _assert_same(step(compiled), step(plain), f"transformers {family}, compiled vs eager")
    assert _breaks() == {}
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # 3 before: one per layer_idx


def _ring_worker(rank: int, world_size: int, mode: str) -> None:
    """One rank: a Llama block over its per-document-zigzag shard, ring attention with packed documents, Selective
    Checkpoint++ or full, compiled vs eager: the same output and gradients, no graph break."""
    import torch._dynamo
    from seqpar_testing import mesh_1d
    from torch._dynamo.utils import counters

    from lightning_seqpar.parallel.parallelize import apply_attention

    torch._dynamo.reset()
    counters.clear()
    mesh = mesh_1d(world_size)
    config = LlamaConfig.from_name("tiny")
    torch.manual_seed(0)
    eager = LlamaBlock(config)
    apply_attention(eager, mesh, attention="ring")
    eager = checkpoint_block(eager, mode)
    compiled = copy.deepcopy(eager)
    compiled.compile(**BACKEND)
    documents = PackedDocuments.from_lengths([[5, 27], [12, 20]], world=world_size)
    x_full = torch.randn(B, 32, config.n_embd)
    x0 = documents.shard(x_full, rank)
    positions = documents.shard(documents.position_ids(), rank)
    freqs = rope_freqs_cis(positions, head_dim=config.head_dim, theta=config.rope_theta)
    for _ in range(2):
        _assert_same(_block_step(compiled, x0, freqs, documents), _block_step(eager, x0, freqs, documents),
                     f"rank {rank}, ring, {mode}")
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])


@pytest.mark.parametrize("mode", ["selective++", "full"])
def test_ring_attention_with_documents_compiles_checkpointed(mode):
    from dist_utils import run_distributed

    run_distributed(_ring_worker, 2, mode, timeout=300, pool="compile")


def test_strategy_trains_compiled_checkpointed_and_offloaded_blocks_like_one_device():
    """``SequenceParallelStrategy(compile=..., offload_checkpoints=1)`` (refused together before issue #56), Selective
    Checkpoint++ and ring over 2 gloo ranks: the losses and weights of the one-device reference. Weights at atol 2e-5
    as the other compiled parity tests (tests/test_parity.py: AdamW's normalised step amplifies last-bit differences
    where a gradient is near zero)."""
    from dist_utils import run_distributed
    from strategy_testing import train_reference, train_strategy

    ref_losses, ref_weights = train_reference()
    kwargs = dict(sequence_parallel_size=2, attention="ring", compile=dict(BACKEND), offload_checkpoints=1)
    results = run_distributed(train_strategy, 2, kwargs, timeout=600, pool="compile")
    losses, weights = results[0]
    assert results[1][0] == losses
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert weights.keys() == ref_weights.keys()
    for name, ref in ref_weights.items():
        torch.testing.assert_close(weights[name], ref, atol=2e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
