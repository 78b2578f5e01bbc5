"""alignloop's benchmarks: speed and quality measurements, each run as a module from the
checkout root (`python -m benchmarks.run`, `python -m benchmarks.vs_trl`, ...); results/ holds
recorded rows. Not part of the installed package."""
