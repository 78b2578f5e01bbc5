"""Language models: loading, packing, the sampler and its log-probs, conversion from GGUF, the
tiny model, the MLflow model files and model cards, LoRA adapters. Imports the floors below
(core, config, data, runtime, schemas)."""
