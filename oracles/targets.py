"""Reference side of the target pair: transformers' own Gemma4ForCausalLM / Qwen3ForCausalLM.

Calls the real model and reads its outputs; forward hooks on the decoder layers give each layer's
raw output (transformers overwrites the last `hidden_states` entry with the final-normed one), and
`return_shared_kv_states=True` gives the Gemma-4 donor K/V as the model itself stores them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

NAME = "transformers"
REQUIRES = {"torch": "2.13.0", "transformers": "5.12.1"}
INSTALL = "pip install torch==2.13.0 transformers==5.12.1   (or: pip install -e '.[oracle]')"


def versions() -> dict[str, str]:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def load(path: str | Path):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(Path(path), dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    return model


def forward(model, ids: np.ndarray) -> dict[str, np.ndarray]:
    import torch

    layers = model.model.layers
    outs: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_hook(
        lambda mod, args, out, i=i: outs.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i, layer in enumerate(layers)]
    gemma = model.config.model_type == "gemma4_text"
    try:
        with torch.no_grad():
            kw = {"return_shared_kv_states": True} if gemma else {}
            res = model(torch.from_numpy(ids), output_hidden_states=True, use_cache=False, **kw)
    finally:
        for h in hooks:
            h.remove()
    out = {"logits": res.logits[0], "hidden.0": res.hidden_states[0][0],
           "final": res.hidden_states[-1][0]}
    for i in range(len(layers)):
        out[f"hidden.{i + 1}"] = outs[i][0]
    if gemma:
        for kind, (k, v) in res.shared_kv_states.items():
            name = kind.split("_")[0]
            out[f"donor.{name}.k"], out[f"donor.{name}.v"] = k[0], v[0]
    return {k: v.detach().float().numpy() for k, v in out.items()}


def greedy(model, prompt: np.ndarray, n: int) -> dict[str, np.ndarray]:
    """transformers' own generate(), greedy, up to n tokens or the config's EOS."""
    import torch
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=n, do_sample=False, output_logits=True,
                           return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        res = model.generate(torch.from_numpy(prompt), generation_config=cfg)
    tokens = res.sequences[0, prompt.shape[1]:].numpy().astype(np.int32)
    logits = torch.stack([x[0] for x in res.logits]).float().numpy()
    return {"stream.tokens": tokens, "stream.logits": logits}
