# The course's two commands:   make lab    (set up, open JupyterLab)
#                              make test   (set up, run the tests, then every notebook with nbval)
PYTHON  ?= python3
VENV    ?= .venv
BUILD   := $(CURDIR)/build
PY      := $(VENV)/bin/python
TORCH   := torch==2.14.1 torchvision==0.29.1
D2L     := d2l==1.0.3

# Everything a run writes (caches, kernel files, checkpoints) goes under build/.
export D2LPAR_BUILD_DIR   := $(BUILD)
export MPLCONFIGDIR       := $(BUILD)/matplotlib
export IPYTHONDIR         := $(BUILD)/ipython
export JUPYTER_RUNTIME_DIR := $(BUILD)/jupyter-runtime
# No .pyc files in the checkout; installed packages keep the bytecode pip compiled for them.
export PYTHONDONTWRITEBYTECODE := 1

# The nbval settings (sanitizing, build folder, kernel, cell timeout) live in conftest.py, so an
# instructor's plain `pytest --nbval-lax notebooks/` runs exactly as `make test` does.
NBVAL_OPTS := --nbval-lax

.PHONY: setup lab test test-avx2 unit notebooks notebooks-one execute bench info gpu clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH)
	@# d2l goes in last and without its stale pins; out first, so that pip never sees its conflicts
	@$(PY) -m pip uninstall --quiet --yes d2l 2>/dev/null || true
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps $(D2L)
	touch $@

# As root (containers, some cloud machines) JupyterLab refuses to start without --allow-root.
lab: setup
	$(VENV)/bin/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) notebooks/

# Most laptops have no AVX-512: torch's AVX2 kernels stand in for such a CPU. A second pass runs what
# computes in low precision (fp16, bf16, fp8 and the losses trained through them), where kernels
# differ most, with them: `make test` passes on both (the README says what it costs).
AVX2_ENV       := ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
AVX2_TESTS     := tests/test_memory_levers.py tests/test_fsdp_checks.py tests/test_threed.py
AVX2_NOTEBOOKS := notebooks/14_memory.ipynb notebooks/17_3d_parallel_planner.ipynb
AVX2_SELECT    := -k "scaler or fp8 or fsdp2 or precision or dtypes or equals_one_device or forgotten \
                      or 14_memory or 17_3d"

test: setup
	$(PY) -m pytest -q tests
	$(PY) -m pytest -q $(NBVAL_OPTS) notebooks
	$(AVX2_ENV) $(PY) -m pytest -q $(NBVAL_OPTS) $(AVX2_SELECT) $(AVX2_TESTS) $(AVX2_NOTEBOOKS)

# The same second pass alone: what a laptop without AVX-512 runs.
test-avx2: setup
	$(AVX2_ENV) $(PY) -m pytest -q $(NBVAL_OPTS) $(AVX2_SELECT) $(AVX2_TESTS) $(AVX2_NOTEBOOKS)

unit: setup
	$(PY) -m pytest -q tests

notebooks: setup
	$(PY) -m pytest -q $(NBVAL_OPTS) notebooks

# Re-execute notebooks in place (what is committed is executed): make execute [NB=notebooks/00_setup.ipynb]
NB ?= notebooks/*.ipynb
# It refuses to run on a busy machine (the timings would be the other programs'): D2LPAR_ALLOW_LOAD=1 overrides.
execute: setup
	$(PY) -m d2lpar quiet
	for nb in $(NB); do \
	  $(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace \
	    --ExecutePreprocessor.timeout=600 "$$nb" || exit 1; done
	$(PY) tests/clean_notebooks.py $(NB)

notebooks-one: setup
	$(PY) -m pytest -q $(NBVAL_OPTS) $(NB)

# On a machine with CUDA: the CUDA tests, every notebook under nbval and bench overlap, one line each,
# the whole output in build/gpu/report.md. Without CUDA it says so and exits 0.
gpu: setup
	$(PY) -m d2lpar gpu

info: setup
	$(PY) -m d2lpar info

bench: setup
	$(PY) -m d2lpar bench launch
	$(PY) -m d2lpar bench overlap
	$(PY) -m d2lpar bench allreduce
	$(PY) -m d2lpar bench ddp
	$(PY) -m d2lpar bench pipeline
	$(PY) -m d2lpar bench tp
	$(PY) -m d2lpar bench zero

clean:
	rm -rf $(BUILD)
