# make train   -- set up the core (torch, transformers, Hydra, the data stack) and DeepSpeed's Python package
#                 (idempotent; no compiled op, no Horovod), then run the default recipe
# make setup EXTRAS=monitors,eval  -- add extras to .venv (dev, deepspeed, monitors, slurm, sweep, finetune, fp8,
#                 eval, horovod, ops; all = every one); a run that needs one it lacks names this command
# make test    -- the cluster tier's apt packages (as root; Open MPI among them, before setup, so that Horovod is
#                built with MPI), set up everything (EXTRAS=all, idempotent), type-check src/ (mypy), check the
#                layering (import-linter, pyproject.toml), run the whole test suite (unit, dist, e2e, cluster,
#                recipes; gpu tests skip without CUDA) on TEST_WORKERS=2 pytest-xdist workers (TEST_WORKERS=0: in
#                this process, one test at a time)
PY := .venv/bin/python

.PHONY: setup train test bench clean
EXTRAS ?=
TEST_WORKERS ?= 2

setup:
	@EXTRAS="$(EXTRAS)" bash scripts/setup.sh

train: setup
	$(PY) train.py $(ARGS)

test:
	@bash scripts/cluster_deps.sh
	@EXTRAS=all bash scripts/setup.sh
	MYPY_CACHE_DIR=$${SHARDYARD_CACHE:-$$HOME/.cache/shardyard}/mypy $(PY) -m mypy
	.venv/bin/lint-imports --no-cache
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

bench: setup
	$(PY) bench/overhead.py
	$(PY) bench/help_time.py

clean:
	rm -rf outputs multirun .pytest_cache
