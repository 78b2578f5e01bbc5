"""The DAG's stages, one module each: `python -m tasks.stages.<name> [--it K]`, what dvc.yaml
runs. A stage module is the edge of one step: it reads its inputs at the paths tasks/core/layout.py
names, calls libraries (the modules in tasks/ outside this package) and writes its outputs and
metrics. No stage imports another (tests/test_dvc_yaml.py); what two stages share is a library.
This file is no dep of any stage; its one statement hands a stage program started under a run's
fork server to it (tasks/runtime/forkserver.py: how a stage starts, not what it computes).
"""
from tasks.runtime.forkserver import delegate

delegate()
