"""What DeepSpeed's own load_checkpoint does with a save directory: the evidence behind docs/layouts.md's table.

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 scripts/probe_deepspeed_load.py \\
        SAVE_DIR STAGE TAG OUT        (TAG "-" for tag=None, i.e. what `latest` names)

Each rank builds the engine tests/_write_deepspeed.py saved with (same tiny model, ZeRO STAGE, torch's AdamW), calls
`load_checkpoint(SAVE_DIR, tag=TAG)` and writes OUT.<rank>.json: the path it loaded and the engine's global_steps, or
the exception. It exits without a further collective, so a rank that failed cannot leave the other hanging.
"""

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import deepspeed.comm.torch  # noqa: E402

# as tests/_write_deepspeed.py: skip the CPU accelerator's shared-memory op, JIT-compiled at init (minutes, a C++
# compiler); it only speeds up collectives and changes nothing a load reads
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
import torch  # noqa: E402


def main(save_dir: str, stage: int, tag: str, out: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = deepspeed.initialize(model=model, optimizer=opt, config=config)[0]
    rank = torch.distributed.get_rank()
    try:
        path, _ = engine.load_checkpoint(save_dir, tag=None if tag == "-" else tag)
        result = {"path": path, "global_steps": engine.global_steps}
    except Exception as exc:  # noqa: BLE001 - what the load raises is the finding
        result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
