"""The records a run is put together into (assembly.py): the model as it is opened and loaded (`Loaded`), and what
a loaded model is (`ModelPart`: a batch shares one model between documents whose parts are equal). What the run
resolved its settings to is its plan as run (runplan.RunPlan.as_run).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..base.modelconfig import ModelConfig
from ..models.forward import Forward
from ..models.store import ModelRef


@dataclass(frozen=True)
class ModelPart:
    """What a loaded model is: documents whose settings resolve to the same part share one model (a batch's cache
    keys on it). Each field but `fingerprint` (the model's, for --model) is resolved from the run option of its
    name, so the options a model depends on are read from this record, not listed again."""

    fingerprint: str
    device: str
    dtype: str
    weights: str
    backend: str
    threads: int
    attention: str
    cuda_graphs: bool
    tp: int


# the run options a model is opened from: --model, and one for each field of the model part
MODEL_OPTIONS = ("model", *(f.name for f in dataclasses.fields(ModelPart) if f.name != "fingerprint"))


@dataclass
class Loaded:
    """The model as it is opened, then loaded: what the later steps of the assembly read. Made once by
    assembly.open_model with every choice; assembly.load_weights fills in `model` and the `backend` it timed."""

    ref: ModelRef
    tok: object
    mcfg: "ModelConfig"  # from config.json, known before the weights are read
    device: str
    dtype: "torch.dtype"
    model: "Forward | None" = None  # set by load_weights(), after every cheaper check has passed
    attention: str = "auto"  # config.ATTENTIONS
    cuda_graphs: bool = False  # wrap the lean model in graphs.GraphedModel (checked: CUDA and the tree kernel)
    weights: str = "float"  # config.WEIGHTS resolved: float, int8 or int4
    tp: int = 1  # tensor-parallel ranks (this process is rank 0 of them when > 1: ranks.py)
    # said once the run starts (after every check of the input, so a refusal stays one sentence)
    weights_note: str | None = None
    backend: str = "torch"  # torch | ggml (backends.py); auto until load_weights has timed both
    threads: int = 0  # CPU threads, fixed; 0: torch's default, governed by load (threads.py)

    @property
    def part(self) -> ModelPart:
        return ModelPart(self.ref.fingerprint, self.device, str(self.dtype).removeprefix("torch."), self.weights,
                         self.backend, self.threads, self.attention, self.cuda_graphs, self.tp)
