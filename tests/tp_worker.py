"""One rank of the tensor-parallel tests (test_parallel.py), started by torch.multiprocessing.spawn: rank 0 leads
the engine through the jobs and writes their tokens; the other ranks follow."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from swiftwrite.models.parallel import Leader, follow, load_sharded
from tiny_lossless import SETTINGS, generate


def run(model, setting: str, drafts: list[str], n: int, budget: int = 6) -> dict:
    """tiny_lossless.generate, as JSON: the tokens, the steps they took and the context rebuilds among them."""
    tokens, steps = generate(model, SETTINGS[setting], drafts, n=n, budget=budget)
    return {"tokens": tokens, "steps": len(steps), "rebuilds": sum(s.rebuilt for s in steps)}


def worker(rank: int, world: int, init_file: str, model_dir: str, out_file: str, jobs: list) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = load_sharded(model_dir, rank, world)
        if rank:
            follow(model)
            return
        leader = Leader(model)
        try:
            results = {name: run(leader, *job) for name, job in jobs}
        finally:
            leader.stop()
        with open(out_file, "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def plan_worker(rank: int, world: int, port: int, model_dir: str, out_file: str, failing: int) -> None:
    """ranks.py's start-up as `swiftwrite generate --tp` runs it, with rank `failing` unable to load its shard (its
    load raises MemoryError, as a machine short of memory would): what rank 0 says, and what each rank returns."""
    import os
    from pathlib import Path
    from types import SimpleNamespace

    from swiftwrite.models import parallel
    from swiftwrite.run import ranks
    from swiftwrite.base.errors import UserError

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    if rank == failing:
        def short_of_memory(*args, **kwargs):
            raise MemoryError("cannot allocate 326 MB")

        parallel.load_sharded = short_of_memory  # what Rank.follow / Rank.lead call, looked up at the call
    here = ranks.join()
    if rank:
        Path(f"{out_file}.rank{rank}").write_text(json.dumps({"returned": here.follow()}))
        leave()
    lm = SimpleNamespace(ref=SimpleNamespace(path=Path(model_dir)), device="cpu", dtype=torch.float32,
                         attention="auto")
    try:
        here.lead(lm, log=lambda msg: None)
        said = None
    except UserError as e:
        said = str(e)
    finally:
        here.release()
    Path(f"{out_file}.rank0").write_text(json.dumps({"said": said}))
    leave()


def leave() -> None:
    """End this rank's process at once, as swiftwrite's ranks do (ranks.py): gloo's worker threads can abort the
    interpreter's finalization ("terminate called without an active exception", SIGABRT), which fails the spawn
    that started it although the rank's work is done and written."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
