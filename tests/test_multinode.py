"""Two "nodes" on this machine: torchrun --nnodes=2 --nproc_per_node=2 (static rendezvous on
localhost, gloo), each rank training under SequenceParallelStrategy with Trainer(num_nodes=2).

Checks (issue #24 item 4) that the strategy reads the node size from the launcher (2 ranks per
node), that the process groups are the node-aware ones (head-first: each hp group inside a node;
context-first double ring: each inner ring inside a node, the outer hops across), and that the
losses and final weights match the single-process reference of tests/test_parity.py. Both
configurations train in one launch, one after the other (tests/multinode_worker.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from strategy_testing import train_reference

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = float(os.environ.get("SEQPAR_MULTINODE_TIMEOUT", 240))


@pytest.fixture(scope="module")
def reference():
    return train_reference()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_two_nodes(out_dir: str, cases: list[dict]) -> list[list[dict]]:
    """One two-node launch running every strategy configuration of ``cases`` in turn; the records by case, then rank."""
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    logs = [open(os.path.join(out_dir, f"node{node}.log"), "w+") for node in (0, 1)]  # files: a full pipe would block a node
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=2",
             "--master_addr=127.0.0.1", f"--master_port={port}", os.path.join(HERE, "multinode_worker.py"), out_dir,
             json.dumps(cases)],
            env=env, stdout=logs[node], stderr=subprocess.STDOUT,
        )
        for node in (0, 1)
    ]
    try:
        for p in procs:
            p.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.wait()
        pytest.fail(f"the two-node run did not finish within {TIMEOUT} s")
    for p, log in zip(procs, logs):
        log.seek(0)
        assert p.returncode == 0, log.read()[-4000:]
        log.close()
    return [[json.load(open(os.path.join(out_dir, f"case{i}", f"rank{r}.json"))) for r in range(4)] for i in range(len(cases))]


def _check_training(records: list[dict], out_dir: str, reference) -> None:
    ref_losses, ref_weights = reference
    for rec in records:
        assert rec["losses"] == records[0]["losses"]  # every rank logs the same global loss
    torch.testing.assert_close(torch.tensor(records[0]["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    weights = torch.load(os.path.join(out_dir, "weights.pt"))
    assert weights.keys() == ref_weights.keys()
    for name, ref in ref_weights.items():
        torch.testing.assert_close(weights[name], ref, rtol=0, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def _node(rank: int) -> int:
    return rank // 2


CASES = [
    # 2D, hp=2 x cp=2, head-first: the all-to-all inside a node, the ring across
    dict(kwargs=dict(sequence_parallel_size=4, head_parallel_size=2, attention="2d", placement="head-first"),
         inside="hp", across="cp"),
    # double ring over cp=4, inner rings of 2 = one node each, context-first (the default)
    dict(kwargs=dict(sequence_parallel_size=4, attention="ring", inner_ring_size=2), inside="inner", across="cp"),
]


@pytest.fixture(scope="module")
def two_node_runs(tmp_path_factory) -> tuple[str, list[list[dict]]]:
    """Every case of CASES trained in one two-node launch: (its output folder, records by case and rank)."""
    out_dir = str(tmp_path_factory.mktemp("two-nodes"))
    return out_dir, _launch_two_nodes(out_dir, [case["kwargs"] for case in CASES])


@pytest.mark.parametrize("index", range(len(CASES)), ids=["2d-head-first", "double-ring-context-first"])
def test_two_nodes_node_aware_placement_and_parity(index, two_node_runs, reference):
    case = CASES[index]
    out_dir, runs = two_node_runs
    records, case_dir = runs[index], os.path.join(out_dir, f"case{index}")
    for rec in records:  # the records are this configuration's
        assert rec["attention"] == case["kwargs"]["attention"]
        assert rec["inner_ring_size"] == case["kwargs"].get("inner_ring_size")
    for rec in records:
        assert rec["node_size"] == 2 and rec["node_rank"] == _node(rec["rank"]) and rec["local_rank"] == rec["rank"] % 2
        inside, across = rec["groups"][case["inside"]], rec["groups"][case["across"]]
        assert rec["rank"] in inside and rec["rank"] in across
        assert {_node(r) for r in inside} == {_node(rec["rank"])}, (case["inside"], inside)  # one node
        assert {_node(r) for r in across} == {0, 1}, (case["across"], across)  # both nodes
        for axis in ("hp", "cp"):  # the process groups are the placement's (ParallelDims.groups)
            if axis in rec["groups"]:
                assert rec["groups"][axis] in rec["expected_groups"][axis]
    if case["kwargs"].get("placement") == "head-first":
        assert [rec["groups"]["hp"] for rec in records] == [[0, 1], [0, 1], [2, 3], [2, 3]]
        assert [rec["groups"]["cp"] for rec in records] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    else:
        assert [rec["groups"]["inner"] for rec in records] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    _check_training(records, case_dir, reference)
