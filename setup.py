"""The wheel carries the pipeline: dvc.yaml and params/ (profiles, prompts, judge templates,
gold examples) go in as package data of `flows`, under flows/pipeline_data/, where
flows/shipped.py finds them. Everything else about the package is in pyproject.toml."""
from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
PIPELINE = ["dvc.yaml", "params"]             # relative to the checkout's root


class BuildWithPipeline(build_py):
    """build_py, plus the pipeline's files copied into the built `flows` package (an editable
    install reads them from the checkout, which is where they are)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        dest = Path(self.build_lib) / "flows" / "pipeline_data"
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        for name in PIPELINE:
            src = HERE / name
            if src.is_dir():
                shutil.copytree(src, dest / name,
                                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(src, dest / name)


setup(cmdclass={"build_py": BuildWithPipeline})
