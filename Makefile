# make train   -- set up (idempotent) and run the default recipe
# make test    -- the cluster tier's apt packages (as root; Open MPI among them, before setup, so that Horovod is
#                built with MPI), set up (idempotent), type-check src/ (mypy), check the layering (import-linter,
#                pyproject.toml), run the whole test suite (unit, dist, e2e, cluster, recipes; gpu tests skip
#                without CUDA)
PY := .venv/bin/python

.PHONY: setup train test bench clean
setup:
	@bash scripts/setup.sh

train: setup
	$(PY) train.py $(ARGS)

test:
	@bash scripts/cluster_deps.sh
	@bash scripts/setup.sh
	MYPY_CACHE_DIR=$${SHARDYARD_CACHE:-$$HOME/.cache/shardyard}/mypy $(PY) -m mypy
	.venv/bin/lint-imports --no-cache
	$(PY) -m pytest tests $(PYTEST_ARGS)

bench: setup
	$(PY) bench/overhead.py
	$(PY) bench/help_time.py

clean:
	rm -rf outputs multirun .pytest_cache
