"""Re-save a GGUF model as a plain Hugging Face directory (safetensors + config + tokenizer).

Servers that cannot read GGUF (vLLM's CPU build) need the same weights in HF format. transformers
dequantizes a GGUF on load, but the loaded model still carries the GGUF quantizer and refuses
`save_pretrained`; so the dequantized state dict is copied into a freshly built `*ForCausalLM` of the
same config, which saves normally. The directory is written once (atomically) and reused afterwards.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

COMPLETE_MARKER = ".export-complete"


def is_exported(out_dir: Path) -> bool:
    return (out_dir / COMPLETE_MARKER).is_file()


def export_gguf_as_hf(gguf: Path, out_dir: Path, dtype: str = "float32") -> Path:
    """`out_dir` holding `gguf`'s weights in HF format (built on the first call; later calls return it).

    `dtype` is the stored dtype of the weights (float32 keeps the dequantized values exactly).
    """
    if is_exported(out_dir):
        return out_dir
    if not gguf.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch  # heavy imports: only when an export is actually needed
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    values = _plain_config(loaded.config.to_dict())
    config = AutoConfig.for_model(str(values.pop("model_type")), **values)
    config.dtype = getattr(torch, dtype)
    plain = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))  # type: ignore[no-untyped-call]
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"GGUF state dict does not fit {config.model_type}: missing {missing}, extra {unexpected}"
        )
    plain.tie_weights()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    plain.save_pretrained(str(staging))
    tokenizer.save_pretrained(str(staging))
    (staging / COMPLETE_MARKER).write_text(f"{gguf}\n")
    shutil.rmtree(out_dir, ignore_errors=True)  # a half-written directory of an interrupted run
    staging.rename(out_dir)
    return out_dir


def _plain_config(values: dict[str, object]) -> dict[str, object]:
    """The model's config without the GGUF loader's leftovers (quantization, the file's own name)."""
    drop = {"quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"}
    return {k: v for k, v in values.items() if k not in drop}
