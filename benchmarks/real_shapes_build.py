"""What ``bench_real_shapes.py`` and ``real_shapes_copy_pair.py`` build from: Qwen3.6-27B's per-layer sizes, the
target's text config, the drafter's shape, and the streaming writer that initialises a model on the meta device one
module at a time (by the class's own ``_init_weights``) into one safetensors file, never the whole model in memory.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REAL_VOCAB = 248_320
#: Qwen3.6-27B's text config, as in bench_rollback.py (Qwen/Qwen3.6-27B config.json, transcribed there).
QWEN3_6_27B = dict(hidden_size=5120, intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                   linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                   linear_conv_kernel_dim=4, full_attention_interval=4)
SAFETENSORS_DTYPE = {"bfloat16": "BF16", "float32": "F32", "float16": "F16"}


def text_config(vocab: int, layers: int):
    from transformers import Qwen3_5TextConfig

    dims = dict(QWEN3_6_27B)
    interval = dims.pop("full_attention_interval")
    layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    return Qwen3_5TextConfig(vocab_size=vocab, num_hidden_layers=layers, layer_types=layer_types, tie_word_embeddings=False,
                             max_position_embeddings=4096, **dims)


def stream_init(model, dest: Path, seed: int) -> int:
    """Initialise ``model`` (on the meta device, bf16) one module at a time by its own rules and stream it into
    ``dest/model.safetensors``: never the whole model in memory. Returns the bytes written."""
    import torch

    owners = [(name, module) for name, module in model.named_modules() if any(True for _ in module.parameters(recurse=False))]
    entries, offset = {}, 0
    for name, module in owners:
        for pname, p in module.named_parameters(recurse=False):
            size = p.numel() * p.element_size()
            entries[f"{name}.{pname}" if name else pname] = {"dtype": SAFETENSORS_DTYPE[str(p.dtype).replace("torch.", "")],
                                                             "shape": list(p.shape), "data_offsets": [offset, offset + size]}
            offset += size
    header = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    dest.mkdir(parents=True, exist_ok=True)
    with open(dest / "model.safetensors", "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for name, module in owners:
            module.to_empty(device="cpu", recurse=False)
            torch.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            with torch.no_grad():
                model._init_weights(module)
            for _, p in module.named_parameters(recurse=False):
                p.data.contiguous().view(torch.uint8).numpy().tofile(f)
            module.to_empty(device="meta", recurse=False)
    return offset


#: a DFlash drafter for Qwen3.6-27B's sizes (as the released drafters are shaped: the target's hidden, MLP and attention
#: sizes, a block of 16, its context read at a few of the target's layers)
DRAFT_LAYERS, DRAFT_BLOCK = 2, 16
