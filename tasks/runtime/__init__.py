"""How a stage process runs: the stage contract and entry point, the device, torchrun ranks, Ray
workers. Imports tasks.core, tasks.config, tasks.schemas."""
