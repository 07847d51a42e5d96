"""The heads inside TokenSwift's own checkpoints (TokenSwift/TokenSwift-Llama-3.1-8B, -Qwen2.5-1.5B / 7B / 14B on
the Hub), as a heads file of ours.

Their layout, from the TokenSwift repository (github.com/bigai-nlco/TokenSwift, models/modeling_llama3_1.py and
modeling_qwen2_5.py, `MedusaModel`; train/model/ has the same): config.json's `medusa_heads` (3) blocks stored with
the model as `model.medusa_layers.{i}.input_layernorm.weight` [D], `.linear.weight` [D, D] (nn.Linear: out × in, no
bias) and `.post_layernorm.weight` [D], applied in a chain to the last layer's output before the model's final norm:

    h_i = h_{i-1} + linear_i(input_layernorm_i(h_{i-1}))        logits_i = lm_head(post_layernorm_i(h_i))

That is heads.py's chain term for term (in_norm, proj, out_norm), with the RMSNorm epsilon of the model
(`rms_norm_eps`) and the whole vocabulary. The file is written once into $SWIFTWRITE_HOME/heads under the model's
fingerprint, where default_heads_path finds it from then on.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .heads import Heads, HeadsError, save_heads, user_dir

PREFIX = "model.medusa_layers."
PARTS = {"in_norm": "input_layernorm.weight", "proj": "linear.weight", "out_norm": "post_layernorm.weight"}


def heads_file(model_dir: Path, fingerprint: str) -> Path | None:
    """Our heads file for the TokenSwift checkpoint in `model_dir` (written now if it is not yet); None when the
    directory holds no TokenSwift heads. HeadsError, one sentence, for a checkpoint whose heads are damaged."""
    model_dir = Path(model_dir)
    out = user_dir() / f"tokenswift-{fingerprint}.safetensors"
    if out.is_file():
        return out
    found: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    if name.startswith(PREFIX):
                        found[name[len(PREFIX):]] = st.get_tensor(name)
        except Exception:  # noqa: BLE001 - a damaged file: the model's own load says so, in its sentence
            return None
    if not found:
        return None
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
        gamma = int(cfg.get("medusa_heads") or 1 + max(int(k.split(".")[0]) for k in found))
        D, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-6))
        vocab = torch.arange(int(cfg["vocab_size"]))
    except (OSError, ValueError, KeyError) as e:
        raise HeadsError(f"the TokenSwift heads in {model_dir} cannot be read: its config.json lacks {e}.") from None
    heads = Heads(D, vocab, gamma, eps)
    with torch.no_grad():
        for ours, theirs in PARTS.items():
            for i in range(gamma):
                t = found.get(f"{i}.{theirs}")
                want = getattr(heads, ours)[i]
                if t is None or t.shape != want.shape or not torch.isfinite(t.float()).all():
                    raise HeadsError(f"the TokenSwift heads in {model_dir} are damaged ({PREFIX}{i}.{theirs} is "
                                     f"missing, misshapen or not finite); pull the model again.")
                want.copy_(t.float())
    return save_heads(heads, out, {"fingerprint": fingerprint, "source": f"TokenSwift checkpoint {model_dir}",
                                   "trained_by": "TokenSwift's authors"})
