"""The Hugging Face support sweep (Note [The Hugging Face support sweep] in lightning_seqpar.hf.support).

Every causal-LM architecture transformers registers, base config and each long-context feature,
at sp 2 and 4, ring / all-gather / Ulysses / 2D, against the unmodified model on the full
sequence, and with packed documents (document_ids, or position_ids restarting at 0) against
every document alone: exact, or refused with a ValueError before any collective. Zero silent mismatches,
except the named known defects (:data:`KNOWN_DEFECTS`, being fixed on another branch).

``SEQPAR_HF_SWEEP=full`` runs everything (minutes) and, with ``SEQPAR_HF_SWEEP_RECORD=path``,
writes the JSON record that ``python -m lightning_seqpar.hf.support`` renders into
docs/hf_support.md. The default run (CI) covers :data:`CI_CASES`, a subset hitting every
feature class, and checks the committed record and table.
"""

from __future__ import annotations

import copy
import json
import os
import time
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dist_utils import run_distributed  # noqa: E402

from lightning_seqpar.hf import support as hf_support  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "hf_support.json"
TABLE = ROOT / "docs" / "hf_support.md"
FULL = os.environ.get("SEQPAR_HF_SWEEP") == "full"
ATOL = 1e-5
RTOL = 1e-5
ALGORITHMS = {2: ("ring", "allgather", "ulysses"), 4: ("ring", "allgather", "ulysses", "2d")}

# Known defects: (architecture or "*", feature or "*") -> cause. A MISMATCH listed here is an
# expected failure (reported, not hidden); empty since the fixes of #21 landed.
KNOWN_DEFECTS: dict[tuple[str, str], str] = {}

# The CI subset: (architecture, features, sp sizes, packed), chosen to hit every feature class and every refusal;
# sp 2 runs ring and Ulysses, sp 4 all-gather and 2D (CI_ALGORITHMS); the packed cases also run on packed documents
# (CI_PACKED: each algorithm with document_ids or with restarting position_ids) against every document alone
CI_CASES: tuple[tuple[str, tuple[str, ...], tuple[int, ...], bool], ...] = (
    ("llama", ("base", "rope_yarn", "rope_dynamic"), (2, 4), True),
    ("qwen2", ("base", "sliding_window"), (2,), False),
    ("mistral", ("sliding_window",), (2,), True),
    ("gemma2", ("softcap",), (2,), True),
    ("gemma3_text", ("base", "sliding_window"), (2,), False),
    ("cwm", ("sliding_window",), (2,), False),
    ("phimoe", ("sliding_window",), (2,), False),
    ("gpt_oss", ("base",), (2,), True),
    ("mimo_v2_flash", ("base",), (2,), False),
    ("phi3", ("base", "rope_longrope"), (2,), True),
    ("mixtral", ("base", "moe_aux"), (2, 4), False),
    ("deepseek_v3", ("base",), (2,), False),
    ("deepseek_v32", ("base",), (2,), False),
    ("llama4_text", ("chunked",), (2, 4), True),
    ("gpt2", ("base",), (2,), True),
    ("bert", ("base",), (2,), False),
    ("olmo2", ("base",), (2,), False),
    ("jamba", ("base",), (2,), False),
    ("falcon_mamba", ("base",), (2,), False),
    ("qwen3_next", ("base",), (2,), True),
)
CI_ALGORITHMS = {2: ("ring", "ulysses"), 4: ("allgather", "2d")}
CI_PACKED = {2: (("ring", "docs"), ("ulysses", "pos")), 4: (("2d", "docs"), ("allgather", "pos"))}


def known_defect(arch: str, feature: str) -> str | None:
    for (a, f), why in KNOWN_DEFECTS.items():
        if a in ("*", arch) and f in ("*", feature):
            return why
    return None


# --------------------------------------------------------------------------------------------- the workers


def _data(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s = hf_support.SEQ_LEN
    tokens = torch.randint(0, hf_support.VOCAB - 8, (2, s), generator=g)
    hf_labels = tokens.clone()  # HF convention: the model shifts them
    hf_labels[0, 6] = -100
    labels = torch.full_like(tokens, -100)  # ours: the next token of the full sequence
    labels[:, :-1] = hf_labels[:, 1:]
    return {"input_ids": tokens, "hf_labels": hf_labels, "labels": labels,
            "position_ids": torch.arange(s).expand(2, s).contiguous()}


# Packed documents (issue #41): each sample packs documents longer and shorter than the window / chunk (8), than the
# dynamic / LongRoPE original length (24) and YaRN's (16); two long ones of different lengths (26, 27) each read their
# own rotary length; one of 1 token; every document spans pieces on several ranks at sp 4 (per-document zigzag)
PACKED_LENGTHS = ((26, 3, 1, 2), (5, 27))
PACKED_MODES = ("docs", "pos")  # document_ids in the batch / position_ids restarting at 0 (the Hugging Face convention)


def _packed_data(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s = hf_support.SEQ_LEN
    tokens = torch.randint(0, hf_support.VOCAB - 8, (2, s), generator=g)
    doc = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in PACKED_LENGTHS])
    same = doc[:, 1:] == doc[:, :-1]
    labels = torch.full_like(tokens, -100)  # the next token of the same document; -100 at every document's end
    labels[:, :-1] = torch.where(same, tokens[:, 1:], -100)
    labels[0, 6] = -100
    index = torch.arange(s).expand(2, s)
    start = torch.cummax(torch.where(torch.cat([torch.ones(2, 1, dtype=torch.bool), ~same], 1), index, 0), dim=1).values
    return {"input_ids": tokens, "labels": labels, "document_ids": doc, "doc_positions": index - start}


def _packed_batch(data: dict[str, torch.Tensor], mode: str) -> dict[str, torch.Tensor]:
    """The batch a user passes: document_ids ("docs") or restarting position_ids ("pos")."""
    if mode == "docs":
        return {"input_ids": data["input_ids"], "labels": data["labels"], "document_ids": data["document_ids"]}
    return {"input_ids": data["input_ids"], "labels": data["labels"], "position_ids": data["doc_positions"]}


def _router_aux_of_documents(model, router_logits: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """transformers' own load-balancing loss of the model's family over every document's tokens together (the
    statistic is over tokens, wherever they sit): ``router_aux_loss_coef * load_balancing_loss_func(...)``."""
    import sys

    fn = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
    names = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")
    if fn is None or not all(isinstance(getattr(model, n, None), (int, float)) for n in names):
        raise hf_support.NotBuilt("no per-document reference of its router loss (no load_balancing_loss_func / "
                                  "num_experts / num_experts_per_tok / router_aux_loss_coef on the model)")
    layers = tuple(torch.cat([logits[i].reshape(-1, logits[i].shape[-1]) for logits in router_logits]) for i in range(len(router_logits[0])))
    return model.router_aux_loss_coef * fn(layers, model.num_experts, model.num_experts_per_tok, None)


def _packed_reference(model, data, attn: str = "eager"):
    """Every document ALONE through a fresh copy of the unmodified model (positions from 0): logits, the mean loss over
    the batch's labels (plus the router loss over all the documents' tokens), gradients summed over the copies."""
    from hf_testing import each_document_alone, summed_grads

    aux = bool(getattr(model.config, "output_router_logits", False))
    logits, copies, routers = each_document_alone(model, data["input_ids"], PACKED_LENGTHS, attn=attn, router_logits=aux)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), data["labels"].flatten(), ignore_index=-100)
    if aux:
        loss = loss + _router_aux_of_documents(copies[0], routers)
    loss.backward()
    return logits.detach(), loss.detach(), summed_grads(model, copies)


def _reference(model, data, attn: str = "eager"):
    """The unmodified model (eager attention) on the full sequence: logits, its own loss, gradients."""
    model.set_attn_implementation(attn)
    model.train()
    out = model(input_ids=data["input_ids"], position_ids=data["position_ids"], labels=data["hf_labels"], use_cache=False)
    out.loss.backward()
    grads = {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()}
    return out.logits.detach(), out.loss.detach(), grads


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"[:400]


def _sp_step(model, mesh, algorithm, data, packed: str | None = None):
    """Our run on the zigzag shards: logits (local), loss (global mean), grads accumulate on the params. ``packed``:
    the batch holds packed documents ("docs": document_ids, "pos": restarting position_ids), sharded as the strategy
    shards it (``batches.shard_batch``: the per-document zigzag, positions inside each document, the documents current)."""
    from lightning_seqpar.hf import HFCausalLM
    from lightning_seqpar.parallel.parallelize import apply_attention
    from lightning_seqpar.sharding import shard_sequence
    from lightning_seqpar.sharding.batches import shard_batch
    from lightning_seqpar.sharding.documents import set_current_documents

    hf_support.check_model_supported(model, max_seq_len=hf_support.SEQ_LEN)
    wrapped = HFCausalLM(model)
    apply_attention(wrapped, mesh, attention=algorithm, layout="zigzag")
    wrapped.train()
    if packed is None:
        ids, pos, labels = (shard_sequence(data[k], mesh, dim=1, layout="zigzag") for k in ("input_ids", "position_ids", "labels"))
    else:
        local = shard_batch(_packed_batch(data, packed), sp=mesh.size(), sp_mesh=mesh, device_mesh=mesh, layout="zigzag",
                            attention=algorithm, pad_to_multiple=False, validate_batches=False, owner="sweep")
        ids, pos, labels = local["input_ids"], local["position_ids"], local["labels"]
    try:
        logits = wrapped(ids, pos)
        loss = _sp_loss(wrapped, mesh, data, logits, labels)
        loss.backward()
    finally:
        if packed is not None:
            set_current_documents(None)
    return logits.detach(), loss.detach()


def _sp_loss(wrapped, mesh, data, logits, labels):
    n_valid = int((data["labels"] != -100).sum())
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                                             reduction="sum") / n_valid
    aux = wrapped.router_aux_loss(mesh)  # MoE: this rank's share of coef x the load-balancing loss (as CausalLMModule adds it)
    return loss if aux is None else loss + aux


def _compare(model, mesh, logits, loss, ref, documents=None, atol: float = ATOL, loss_atol: float | None = None) -> str | None:
    """None if logits, loss and every gradient match the reference, else what differs (by how much)."""
    import torch.distributed as dist

    from lightning_seqpar.sharding.batches import gather_sequence
    from lightning_seqpar.sharding.documents import packed_documents

    ref_logits, ref_loss, ref_grads = ref
    with packed_documents(documents):  # the layout's or the per-document zigzag's order
        full = gather_sequence(logits.contiguous(), sp_mesh=mesh, layout="zigzag")
    total = loss.clone()
    dist.all_reduce(total)
    worst: list[tuple[float, str]] = []
    if full.shape != ref_logits.shape:
        return f"logits shape {tuple(full.shape)} != {tuple(ref_logits.shape)}"
    worst.append((float((full - ref_logits).abs().max()), "logits"))
    worst.append((float((total - ref_loss).abs()) * atol / (atol if loss_atol is None else loss_atol), "loss"))
    for name, p in model.named_parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        dist.all_reduce(g)
        r = ref_grads.get(name)
        r = torch.zeros_like(p) if r is None else r
        worst.append((float((g - r).abs().max() - RTOL * r.abs().max()), f"grad {name}"))
    bad = [(d, what) for d, what in worst if d > atol]
    if not bad:
        return None
    bad.sort(reverse=True)
    return "; ".join(f"{what} off by {d:.2e}" for d, what in bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "")


def _run_one(model, mesh, algorithm, data, ref, packed: str | None = None) -> dict[str, str]:
    """One (model, algorithm[, packing]) case: exact / refused / MISMATCH / error (``ref`` an exception: no reference,
    "not built" unless refused)."""
    import torch.distributed as dist
    from seqpar_testing import no_collectives

    from lightning_seqpar.sharding.documents import batch_documents
    from lightning_seqpar.sharding.layouts import mesh_sizes

    trial = copy.deepcopy(model)
    probe: str
    with no_collectives():  # the first step may not communicate before a refusal
        try:
            _sp_step(trial, mesh, algorithm, data, packed)
            probe = "ran"
        except ValueError as error:  # P2POp refuses the guard's stand-in for dist.isend: that is communication
            probe = "collective" if "Invalid ``op``" in str(error) else "refused: " + _error_text(error)
        except RuntimeError as error:
            probe = "collective" if "collective ran" in str(error) else "error: " + _error_text(error)
        except Exception as error:  # noqa: BLE001
            probe = "error: " + _error_text(error)
    probes = [None] * dist.get_world_size()
    dist.all_gather_object(probes, probe)
    if len(set(probes)) > 1:
        return {"status": "error", "detail": f"ranks disagree before any collective: {sorted(set(probes))}"}
    if probe.startswith("refused: "):
        return {"status": "refused", "detail": probe.removeprefix("refused: ")}
    if probe.startswith("error: "):
        return {"status": "error", "detail": probe.removeprefix("error: ")}
    if isinstance(ref, Exception):  # it runs, but there is nothing to compare it with
        return {"status": "not built", "detail": "no per-document reference: " + _error_text(ref)}
    trial = copy.deepcopy(model)
    try:
        logits, loss = _sp_step(trial, mesh, algorithm, data, packed)
    except ValueError as error:
        return {"status": "error", "detail": "refused only after a collective: " + _error_text(error)}
    except Exception as error:  # noqa: BLE001
        return {"status": "error", "detail": _error_text(error)}
    documents = None if packed is None else batch_documents(_packed_batch(data, packed), world=mesh_sizes(mesh)[2])
    diff = _compare(trial, mesh, logits, loss, ref, documents)
    if diff is None:
        return {"status": "exact"}
    exact64 = _exact_in_float64(model, mesh, algorithm, data, packed, documents)
    if exact64 is not None:  # Note [Rounding or a defect]
        return {"status": "exact", "detail": f"fp32 {diff}; float64 against transformers' sdpa: {exact64}"}
    return {"status": "MISMATCH", "detail": diff}


# Note [Rounding or a defect]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A run off by a little more than the fp32 tolerance can be rounding: a model whose logits pass through many
# norms amplifies the different summation orders of the masked (packed) attention and of the reference (Gemma 4:
# 1.2e-5 on logits of about 2). The reference's eager attention casts the softmax to fp32 even on float64 inputs,
# so the same run in float64 against transformers' SDPA (no cast) decides: a defect stays (a wrong mask or
# position changes the result at any precision), rounding falls to ~1e-15 (the logits and every gradient to
# EXACT64; the loss, computed in fp32 on both sides, to the fp32 tolerance). Such a run counts as exact and says both
# numbers.
EXACT64 = 1e-9


def _exact_in_float64(model, mesh, algorithm, data, packed, documents) -> str | None:
    """The run again in float64 against transformers' SDPA: "max difference ..." if it matches to EXACT64, else None."""
    import torch.distributed as dist

    try:
        double = copy.deepcopy(model).double()
        ref = (_packed_reference if packed else _reference)(double, data, attn="sdpa")
        trial = copy.deepcopy(double)
        logits, loss = _sp_step(trial, mesh, algorithm, data, packed)
        # the losses are computed in fp32 on both sides (transformers' loss upcasts the logits to fp32): fp32 tolerance
        diff = _compare(trial, mesh, logits, loss, ref, documents, atol=EXACT64, loss_atol=ATOL)
    except Exception:  # noqa: BLE001 - no float64 run: the fp32 verdict stands
        diff = "no float64 run"
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, diff)
    return None if any(v is not None for v in verdicts) else f"every difference below {EXACT64:g}"


def sweep_worker(rank: int, world_size: int, cases: list[tuple[str, str]], algorithms: tuple[str, ...] | None = None,
                 packed_runs: tuple[tuple[str, str], ...] | None = None) -> dict | None:
    """Run on every pooled rank: each (architecture, feature) case for every algorithm at sp = world size, on a plain
    batch (run ``sp{W}/{algorithm}``) and on packed documents (run ``sp{W}/{algorithm}/{mode}``, mode "docs" or
    "pos", for each (algorithm, mode) of ``packed_runs``; None: every algorithm in both modes; (): none), each against
    its single-device reference: the whole sequence, or every document alone."""
    warnings.filterwarnings("ignore")
    import logging

    from torch.distributed.device_mesh import init_device_mesh

    transformers.logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    meshes = {"ring": init_device_mesh("cpu", (world_size,), mesh_dim_names=("sp",))}
    if world_size == 4:
        meshes["2d"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("hp", "cp"))
    data = _data()
    packed_data = _packed_data()
    out: dict[str, dict] = {}
    for arch, feature in cases:
        key = f"{arch}/{feature}"
        t0 = time.perf_counter()
        try:
            model = hf_support.build_tiny_model(arch, None if feature == "base" else feature)
        except hf_support.NotBuilt as error:
            out[key] = {"status": "not built", "detail": str(error)}
            continue
        try:
            ref = _reference(copy.deepcopy(model), data)
        except Exception as error:  # noqa: BLE001
            out[key] = {"status": "not built", "detail": "the unmodified model does not run: " + _error_text(error)}
            continue
        runs = {}
        for algorithm in ALGORITHMS[world_size] if algorithms is None else algorithms:  # (): packed runs only
            mesh = meshes["2d" if algorithm == "2d" else "ring"]
            runs[f"sp{world_size}/{algorithm}"] = _run_one(model, mesh, algorithm, data, ref)
        if packed_runs is None:
            packed_runs = tuple((a, m) for a in ALGORITHMS[world_size] for m in PACKED_MODES)
        if packed_runs:
            try:
                packed_ref = _packed_reference(model, packed_data)
            except Exception as error:  # noqa: BLE001
                packed_ref = error
            for algorithm, mode in packed_runs:
                mesh = meshes["2d" if algorithm == "2d" else "ring"]
                runs[f"sp{world_size}/{algorithm}/{mode}"] = _run_one(model, mesh, algorithm, packed_data, packed_ref, mode)
        out[key] = {"status": "ran", "runs": runs}
        if os.environ.get("SEQPAR_HF_SWEEP_TIMING"):
            print(f"rank {rank}: {key} {time.perf_counter() - t0:.2f}s", flush=True)
    return out if rank == 0 else None


# --------------------------------------------------------------------------------------------- running it


def _sweep(cases: list[tuple[str, str]], world_size: int, timeout: float = 900, algorithms: tuple[str, ...] | None = None,
           packed_runs: tuple[tuple[str, str], ...] | None = None) -> dict:
    return run_distributed(sweep_worker, world_size, cases, algorithms, packed_runs, timeout=timeout)[0]


def _failures(results: dict) -> list[str]:
    """Silent mismatches outside KNOWN_DEFECTS (and errors, which are not refusals)."""
    bad = []
    for key, case in results.items():
        arch, feature = key.split("/")
        for where, run in case.get("runs", {}).items():
            if run["status"] == "MISMATCH" and known_defect(arch, feature) is None:
                bad.append(f"{key} {where}: {run['detail']}")
    return bad


def _xfailed(results: dict) -> list[str]:
    return [f"{key} {where}" for key, case in results.items() for where, run in case.get("runs", {}).items()
            if run["status"] == "MISMATCH" and known_defect(*key.split("/"))]


def test_ci_subset_is_exact_or_refused():
    by_world: dict[tuple[int, bool], list[tuple[str, str]]] = {}
    for arch, features, sizes, packed in CI_CASES:
        for w in sizes:
            by_world.setdefault((w, packed), []).extend((arch, f) for f in features)
    results = {}
    for (w, packed), cases in sorted(by_world.items()):
        part = _sweep(cases, w, algorithms=CI_ALGORITHMS[w], packed_runs=CI_PACKED[w] if packed else ())
        results.update({f"{k}@{w}": v for k, v in part.items()})
    bad = [line for key, case in results.items() for line in _failures({key.split("@")[0]: case})]
    assert not bad, "silent mismatches:\n" + "\n".join(bad)
    built = {k: v for k, v in results.items() if v["status"] == "ran"}
    assert len(built) >= len(results) - 2, {k: v for k, v in results.items() if v["status"] != "ran"}
    statuses = {run["status"] for case in built.values() for run in case["runs"].values()}
    assert "exact" in statuses and "refused" in statuses
    packed_runs = [run["status"] for case in built.values() for where, run in case["runs"].items() if hf_support.is_packed_run(where)]
    assert len(packed_runs) >= 30 and set(packed_runs) <= {"exact", "refused"}, packed_runs
    # the committed record agrees with this run, except where a known defect is being fixed elsewhere
    record = json.loads(RECORD.read_text())
    for key, case in results.items():
        name = key.split("@")[0]
        arch, feature = name.split("/")
        recorded = record["cases"].get(name)
        assert recorded is not None, f"{name} missing from {RECORD}: re-run the full sweep"
        assert recorded["status"] == case["status"], (name, recorded, case)
        for where, run in case.get("runs", {}).items():
            if known_defect(arch, feature) or where not in recorded.get("runs", {}):
                continue
            assert recorded["runs"][where]["status"] == run["status"], (name, where, recorded["runs"][where], run)


@pytest.mark.timeout(4 * 3600)
@pytest.mark.skipif(not FULL, reason="the full sweep runs with SEQPAR_HF_SWEEP=full")
def test_full_sweep():
    """Every architecture: base and each feature at sp 2; at sp 4 the base config (every feature with
    SEQPAR_HF_SWEEP_SP4=all); each on a plain batch and on packed documents. Writes the record after each
    architecture (SEQPAR_HF_SWEEP_RECORD). SEQPAR_HF_SWEEP_PLAIN=0 / SEQPAR_HF_SWEEP_PACKED=0 skip the plain / packed
    runs; SEQPAR_HF_SWEEP_MERGE=record.json starts from that record's cases and replaces the runs this sweep makes
    (a sweep of some architectures or of one dimension updates the record without re-running the rest)."""
    archs = hf_support.causal_lm_architectures()
    only = os.environ.get("SEQPAR_HF_SWEEP_ARCHS")
    if only:
        archs = [a for a in archs if a in only.split(",")]
    sp4 = os.environ.get("SEQPAR_HF_SWEEP_SP4", "base")  # "all", "base" or "none"
    sizes = [int(w) for w in os.environ.get("SEQPAR_HF_SWEEP_SIZES", "2,4").split(",")]
    skip = set(filter(None, os.environ.get("SEQPAR_HF_SWEEP_SKIP_FEATURES", "").split(",")))
    plain = os.environ.get("SEQPAR_HF_SWEEP_PLAIN", "1") != "0"
    packed = os.environ.get("SEQPAR_HF_SWEEP_PACKED", "1") != "0"
    path = os.environ.get("SEQPAR_HF_SWEEP_RECORD")
    merge = os.environ.get("SEQPAR_HF_SWEEP_MERGE")
    results: dict[str, dict] = copy.deepcopy(json.loads(Path(merge).read_text())["cases"]) if merge else {}
    for arch in archs:
        try:
            features = ["base", *(f for f in hf_support.features_of(arch) if f not in skip)]
        except hf_support.NotBuilt as error:
            results[f"{arch}/base"] = {"status": "not built", "detail": str(error)}
            continue
        plan = {2: features, 4: {"all": features, "base": ["base"], "none": []}[sp4]}
        for w, chosen in ((w, plan[w]) for w in sizes if plan[w]):
            cases = [(arch, f) for f in chosen]
            try:
                algos = os.environ.get(f"SEQPAR_HF_SWEEP_ALGOS_{w}")
                algorithms = tuple(algos.split(",")) if algos else None
                part = _sweep(cases, w, timeout=900, algorithms=algorithms if plain else (), packed_runs=None if packed else ())
            except (AssertionError, TimeoutError, RuntimeError) as error:  # a crash or hang of one architecture
                part = {f"{arch}/{f}": {"status": "ran", "runs": {f"sp{w}/*": {
                    "status": "error", "detail": f"worker failed: {str(error).strip().splitlines()[-1][:300]}"}}}
                    for f in chosen}
            for key, case in part.items():
                merged = results.setdefault(key, {"status": case["status"]})
                if case["status"] == "ran":
                    merged["status"] = "ran"
                    merged.pop("detail", None)
                    merged.setdefault("runs", {}).update(case["runs"])
                elif "runs" not in merged:
                    merged.update(case)
        print(arch, {k: v["status"] for k, v in results.items() if k.startswith(arch + "/")}, flush=True)
        if path:
            known = {k: why for k in results if (why := known_defect(*k.split("/")))}
            record = hf_support.make_record(results, known=known, packed_lengths=PACKED_LENGTHS)
            Path(path).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    bad = _failures(results)
    assert not bad, "silent mismatches:\n" + "\n".join(bad)


def test_the_table_is_generated_from_the_record():
    record = json.loads(RECORD.read_text())
    assert TABLE.read_text() == hf_support.render_markdown(record), (
        "docs/hf_support.md is not the rendering of docs/hf_support.json: run "
        "python -m lightning_seqpar.hf.support --record docs/hf_support.json --write docs/hf_support.md")
    assert record["archs_walked"] == len(hf_support.causal_lm_architectures()) or record["transformers"] != transformers.__version__


# --------------------------------------------------------------------------------------------- one process


@pytest.mark.parametrize("arch", ["rwkv", "xlstm"])
def test_token_mixing_layers_are_refused_by_name(arch):
    model = hf_support.build_tiny_model(arch)
    with pytest.raises(ValueError, match=r"ForCausalLM mixes tokens with layers other than attention \(.*'[\w.]+\.(0|1)[\w.]*' "
                                         r"\(\w+\).*passes the state between ranks only for BambaMixer"):
        hf_support.check_model_supported(model)


@pytest.mark.parametrize("arch", ["lfm2", "qwen3_next", "qwen3_5_text", "bamba", "mamba", "falcon_mamba", "jamba", "zamba",
                                  "mamba2", "zamba2", "falcon_h1", "olmo_hybrid", "minimax", "kimi_linear",
                                  "recurrent_gemma"])
def test_hybrid_mixers_with_sequence_parallel_twins_pass_the_check(arch):
    """Note [Hybrid models under the strategy]: the sweep runs them exact at sp 2 and 4."""
    hf_support.check_model_supported(hf_support.build_tiny_model(arch), max_seq_len=hf_support.SEQ_LEN)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text", "mixtral"])
def test_attention_only_models_pass_the_check(arch):
    hf_support.check_model_supported(hf_support.build_tiny_model(arch), max_seq_len=hf_support.SEQ_LEN)


def test_sparse_attention_indexers_are_refused_by_name():
    model = hf_support.build_tiny_model("deepseek_v32")
    with pytest.raises(ValueError, match=r"model_type='deepseek_v32'.*lightning indexer \(DeepseekV32Indexer at "
                                         r"'model.layers.0.self_attn.indexer'"):
        hf_support.check_model_supported(model, max_seq_len=hf_support.SEQ_LEN)


@pytest.mark.parametrize("arch, feature", [
    ("mimo_v2_flash", None), ("gpt_oss", None), ("gemma2", None), ("cwm", "sliding_window"),
    ("llama4_text", "chunked"), ("phimoe", "sliding_window"), ("mistral", "sliding_window"),
])
def test_windows_chunks_softcaps_and_sinks_pass_the_check(arch, feature):
    """Computed by the package's attention since #21 (the sweep checks them against the model)."""
    hf_support.check_model_supported(hf_support.build_tiny_model(arch, feature), max_seq_len=hf_support.SEQ_LEN)
    hf_support.check_model_supported(hf_support.build_tiny_model(arch, feature))


def test_tiny_configs_switch_the_feature_on():
    assert hf_support.tiny_config("mistral").sliding_window > hf_support.SEQ_LEN
    assert hf_support.tiny_config("mistral", "sliding_window").sliding_window < hf_support.SEQ_LEN
    assert hf_support.tiny_config("gemma2", "softcap").attn_logit_softcapping == 0.5
    assert hf_support.tiny_config("llama", "rope_yarn").rope_parameters["rope_type"] == "yarn"
    assert hf_support.tiny_config("mixtral", "moe_aux").output_router_logits is True
    jamba = hf_support.tiny_config("jamba")
    assert {"attention", "mamba"} <= set(jamba.layers_block_type)  # every layer kind kept
    with pytest.raises(ValueError, match="no config field for feature 'softcap'"):
        hf_support.tiny_config("llama", "softcap")
    with pytest.raises(hf_support.NotBuilt, match="encoder-decoder"):
        hf_support.tiny_config("bart")


def test_minimax_full_attention_layers_take_the_config_window():
    """MiniMax builds the masks of its "full_attention" layers with config.sliding_window (Mixtral's masking):
    read as windowed (the sweep found the mismatch once its lightning attention ran exact); other models'
    "full_attention" layers stay full whatever their config says."""
    from lightning_seqpar.hf.features import attention_features

    windowed = hf_support.build_tiny_model("minimax", "sliding_window").model.layers[1].self_attn
    assert type(windowed).__name__ == "MiniMaxAttention"
    assert attention_features(windowed).window == hf_support.WINDOW
    assert attention_features(hf_support.build_tiny_model("minimax").model.layers[1].self_attn).window is None
    qwen3_next = hf_support.build_tiny_model("qwen3_next").model.layers[1].self_attn  # layer_types[1] = "full_attention"
    qwen3_next.config.sliding_window = hf_support.WINDOW
    assert attention_features(qwen3_next).window is None
