"""Stage `prepare_model`: the initial policy (iteration 0), saved as safetensors in the workspace.

Sources: `tiny` (random init from a config on SmolLM2's tokenizer, for tests), `gguf` (a GGUF
file shipped inside an installed package, de-quantized once; the default SmolLM2-135M-Instruct),
`hf_dir` (a local directory written by save_pretrained). The result is DVC-tracked, so the
conversion runs once. The tiny tokenizer, read out of the GGUF, is cached in
$ALIGNLOOP_CACHE_DIR, else in the workspace's git-ignored `.alignloop/cache`.
"""
from __future__ import annotations

from tasks.runtime import stage  # first: a CLI-started stage ends quietly on Ctrl-C

# isort: split

import os
import shutil
import time
from pathlib import Path

from tasks.core import atomic, layout
from tasks.models import lm, mlflow_model, model_card
from tasks.schemas.model import ModelParams

CONTRACT = stage.Contract(
    "prepare_model", params=("seed", "model"),
    outs=lambda it, prev: (layout.policy(0),))


_HF_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja")
WORKSPACE_CACHE = ".alignloop/cache"     # inside flows.workspace.STATE_DIR (git-ignored)


def copy_hf_dir(src: Path, out_dir: Path) -> dict[str, object]:
    lm.check_model_dir(src)
    if not list(src.glob("*.safetensors")):
        raise lm.ModelError(f"{src}: no *.safetensors weights (save with safe_serialization)")
    for pattern in _HF_FILES:
        for f in src.glob(pattern):
            shutil.copy2(f, out_dir / f.name)
    lm.load_tokenizer(out_dir)            # fail now, not three stages later
    check_weights(src, out_dir)
    return {"copied_from": str(src)}


def check_weights(src: Path, out_dir: Path) -> None:
    """Read every tensor of every weights file, then load the model once: a truncated or
    corrupt file fails here, named, not two stages later as a raw SafetensorError."""
    from safetensors import safe_open
    for f in sorted(out_dir.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    st.get_tensor(key)
        except Exception as e:  # noqa: BLE001 (any failure to read is the finding)
            raise lm.ModelError(f"{src / f.name}: unreadable weights "
                                f"({type(e).__name__}: {e})") from None
    try:
        lm.load_causal_lm(out_dir)
    except Exception as e:  # noqa: BLE001 (any failure to load is the finding)
        raise lm.ModelError(f"{src}: not a loadable causal LM ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from None


def prepare(p: ModelParams, seed: int, out_dir: Path, root: Path) -> dict[str, object]:
    """Write the initial model and tokenizer into the (new, empty) out_dir; returns info
    (deterministic: it is stored with the model, and equal inputs must give equal bytes)."""
    if p.source == "tiny":
        from tasks.models.tiny_model import CACHE_ENV, save_tiny
        info = save_tiny(p.tiny, seed, out_dir,
                         Path(os.environ.get(CACHE_ENV) or root / WORKSPACE_CACHE))

    elif p.source == "gguf":
        from tasks.models.gguf_convert import convert_gguf_to_hf, find_packaged_gguf
        info = convert_gguf_to_hf(find_packaged_gguf(p.gguf_package, p.gguf_file or None), out_dir)
    else:
        info = copy_hf_dir(root / Path(p.path).expanduser(), out_dir)   # absolute paths win
    info.pop("seconds", None)
    if "source" in info:
        info["source_file"] = info.pop("source")
    return {**info, "source": p.source}


def main(argv: list[str] | None = None) -> None:
    args = stage.parse(argv, __doc__ or "", CONTRACT)
    out = args.root / layout.policy(0)
    t0 = time.perf_counter()
    with atomic.directory(out) as tmp:
        info = prepare(args.params.model, args.params.seed, tmp, args.root)
        atomic.write_json(tmp / layout.MODEL_META, {"iteration": 0, "role": "policy", **info})
        mlflow_model.write_mlflow_model(tmp, mlflow_model.CHAT, {"model_path": layout.policy(0)})
        model_card.write_model_card(tmp, args.root, "prepare_model", 0, args.params, {})
    stage.say(f"prepare_model: {info['source']} model at {layout.policy(0)} "
              f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    stage.run_main(lambda: main())
