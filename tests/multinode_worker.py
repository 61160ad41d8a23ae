"""One rank of the two-"node" CPU run of tests/test_multinode.py, started by torchrun.

    torchrun --nnodes=2 --node_rank=K --nproc_per_node=2 --master_addr=127.0.0.1 --master_port=P \
        tests/multinode_worker.py OUT_DIR '[{"sequence_parallel_size": 4, ...}, ...]'

For each strategy configuration of the list, one after another in this process (one launch for
all: starting two nodes of two ranks costs more than a run), trains the tiny GQA Llama of
tests/strategy_testing.py for its steps under SequenceParallelStrategy(**kwargs) with
Trainer(devices=2, num_nodes=2) and writes OUT_DIR/case{I}/rank{R}.json: the logged losses, the
strategy's node view (node rank, local rank) and the global ranks of this rank's hp, cp and
inner-ring groups as the process groups hold them; rank 0 also writes the final full weights to
OUT_DIR/case{I}/weights.pt. (Under torchrun a strategy leaves the default group to the launcher's
process, so the next configuration's strategy finds it.)
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from strategy_testing import GLOBAL_BATCH, STEPS, _dataloader, _LossRecorder, _module, _trainer  # noqa: E402


def main() -> None:
    warnings.filterwarnings("ignore")
    out_dir, cases = sys.argv[1], json.loads(sys.argv[2])
    for i, kwargs in enumerate(cases):
        case_dir = os.path.join(out_dir, f"case{i}")
        os.makedirs(case_dir, exist_ok=True)
        run(case_dir, kwargs)
    # every rank done, then the groups torn down before the interpreter exits: left to static destruction, gloo's
    # threads were seen to abort a rank at exit ("terminate called without an active exception", SIGABRT), and the
    # other node's launcher then waited for it until the test's timeout
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run(out_dir: str, kwargs: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lightning_seqpar import SequenceParallelStrategy

    strategy = SequenceParallelStrategy(**kwargs)
    recorder = _LossRecorder()
    module = _module("tiny")
    nodes, per_node = int(os.environ["GROUP_WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    dp = nodes * per_node // kwargs["sequence_parallel_size"]
    trainer = _trainer(strategy, per_node, recorder, STEPS, num_nodes=nodes)
    trainer.fit(module, train_dataloaders=_dataloader(GLOBAL_BATCH // dp))
    mesh, dims = strategy.device_mesh, strategy.parallel_dims
    groups = {axis: dist.get_process_group_ranks(mesh.get_group(axis)) for axis in ("hp", "cp") if mesh[axis].size() > 1}
    inner = strategy.inner_ring_size
    if inner is not None:  # the ring's own rule: inner ring = `inner` consecutive ranks of the cp group
        cp_ranks = groups["cp"]
        j = cp_ranks.index(dist.get_rank()) // inner * inner
        groups["inner"] = cp_ranks[j:j + inner]
    record = dict(
        rank=dist.get_rank(), node_rank=strategy.node_rank, local_rank=strategy.local_rank, losses=recorder.losses,
        groups=groups, placement=dims.placement, node_size=dims.node_size, hp=dims.hp, cp=dims.cp,
        attention=strategy.attention, inner_ring_size=inner,
        expected_groups={axis: dims.groups(axis) for axis in ("hp", "cp")},
    )
    state = get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save(state, os.path.join(out_dir, "weights.pt"))
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
