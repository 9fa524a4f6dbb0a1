# Two commands do all set-up: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all test-titan test-trl lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Without CUDA, take the pinned CPU wheel so pip never pulls a multi-GB CUDA build; one resolve for all
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then torch="torch>=2.5"; \
	else torch="torch==2.13.0"; fi; \
	$(BIN)/python -m pip install -q --no-compile "$$torch" -e ".[test,hf]"
	# bytecode on every core (pip compiles one file at a time); the packages' own test suites stay source
	$(BIN)/python -m compileall -q -j 0 -x '/(tests?|testing/_internal)/' $(VENV)/lib >/dev/null
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/cpattn bench

# the package's bytecode first: every worker process the tests start imports it (and none writes it where
# PYTHONDONTWRITEBYTECODE is set)
test: $(STAMP)
	$(BIN)/python -m compileall -q -j 0 cpattn tests >/dev/null
	$(BIN)/python -m pytest -q

# everything, the slow cases too; the torchtitan runs only where torchtitan is installed (make test-titan)
test-all: $(STAMP)
	if $(BIN)/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torchtitan') is None)"; then \
		$(BIN)/python -m pytest -q -m ""; \
	else \
		$(BIN)/python -m pytest -q -m "not titan"; \
	fi

TITAN_STAMP := $(VENV)/.titan-installed

$(TITAN_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e ".[titan]"
	touch $(TITAN_STAMP)

# torchtitan trained with cpattn (the titan extra: torchtitan 0.3.0 and triton; several minutes on 2 cores)
test-titan: $(TITAN_STAMP)
	$(BIN)/python -m pytest -q -m titan

TRL_STAMP := $(VENV)/.trl-installed

$(TRL_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e ".[trl]"
	touch $(TRL_STAMP)

# TRL's SFTTrainer fine-tuned with cpattn (the trl extra: trl 1.16.0; about two minutes on 2 cores)
test-trl: $(TRL_STAMP)
	$(BIN)/python -m pytest -q -m trl

lint: $(STAMP)
	$(BIN)/ruff check cpattn tests examples

clean:
	rm -rf $(VENV) build *.egg-info
