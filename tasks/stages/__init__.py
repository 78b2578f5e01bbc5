"""The DAG's stages, one module each: `python -m tasks.stages.<name> [--it K]`, what dvc.yaml
runs. A stage module is the edge of one step: it reads its inputs at the paths tasks/core/layout.py
names, calls libraries (the modules in tasks/ outside this package) and writes its outputs and
metrics. No stage imports another (tests/test_dvc_yaml.py); what two stages share is a library.
This file holds no code: it is no dep of any stage.
"""
