# Sluice — every target sets itself up from nothing (docs/architecture.md §1).
#
#   make demo    run the scripted two-policy demo
#   make test    run the test suite
#   make test-fast  the suite without its slow tiers (real vLLM, real clients, Ray, long runs):
#                the edit-run loop, under 3 minutes on 2 cores
#   make fuzz    the fuzz tier's long run: 100,000 inputs per target, FUZZ_JOBS targets at a
#                time (tests/fuzz; about 6 CPU-hours in all, the longest target ~1.7 h;
#                FUZZ=tests/fuzz/<file>[::<test>] runs one target). `make test` runs the same
#                targets with a few hundred inputs each
#   make bench   print BENCH <name> <value> <unit> lines (progress goes to stderr)
#   make soak    1 hour, 512 agent sessions through the gateway on 4 simworkers, a fault every
#                5 minutes (worker kill, hang, restart; gateway reload; bad input); summary in
#                experiments/results/soak/ (SOAK_ARGS="--duration-s 240 --sessions 32" shortens it)
#   make clean   remove caches and build outputs (keeps .venv); `make distclean` also drops .venv

PYTHON ?= python3
VENV   ?= .venv
VPY    := $(VENV)/bin/python
EXTRAS := live,plots,dev,clients,tune
# Installed after EXTRAS, best effort: where no Ray wheel fits the platform or Python the
# Ray tier (tests/ray) skips, saying so, instead of the whole set-up failing.
OPTIONAL_EXTRAS := ray
# Rebuilt when the dependency list changes; otherwise `make venv` is a no-op.
STAMP  := $(VENV)/.sluice-installed

.PHONY: venv vllm-venv proxy test test-fast fuzz demo bench soak clean distclean

venv: $(STAMP)

# Set-up output goes to stderr, so `make bench` keeps stdout for BENCH lines even on a
# first run.
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Sluice needs Python >= 3.11; set PYTHON=python3.11 (found " + sys.version.split()[0] + ")")'
	@test -x $(VPY) || { echo "creating $(VENV) with $(PYTHON)" >&2; $(PYTHON) -m venv $(VENV) >&2; }
	@echo "installing Sluice into $(VENV) (editable, extras $(EXTRAS), then $(OPTIONAL_EXTRAS) if it installs)" >&2
	@$(VPY) -m pip install -e '.[$(EXTRAS)]' >&2
	@$(VPY) -m pip install -e '.[$(EXTRAS),$(OPTIONAL_EXTRAS)]' >&2 \
		|| echo "warning: could not install the $(OPTIONAL_EXTRAS) extra; its tests will skip" >&2
	@touch $@

# vLLM's CPU build in its own virtualenv (the gateway never imports it): the fidelity and
# end-to-end tiers drive real vLLM code. The script is idempotent and fast once installed.
vllm-venv:
	bash scripts/setup_vllm_venv.sh

# nginx, the proxy the sharded-gateway configuration (ops/nginx/) is tested with: installed
# from the system's packages where this runs as root (CI); elsewhere its tests skip.
proxy:
	@bash scripts/setup_proxy.sh

test: venv vllm-venv proxy
	$(VPY) -m pytest -q tests

# What is slow is listed in tests/conftest.py; no vLLM needed.
test-fast: venv
	$(VPY) -m pytest -q -m "not slow" tests

# The profile is tests/fuzz/profiles.py's: random seeds, no deadline, failures kept in
# .hypothesis/ so that the next run tries them first. Targets run side by side, FUZZ_JOBS at a
# time (default: the CPUs), each logged to .fuzz-logs/ (tests/fuzz/long_run.py).
FUZZ ?= tests/fuzz
FUZZ_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
fuzz: venv
	$(VPY) -m tests.fuzz.long_run --jobs $(FUZZ_JOBS) $(FUZZ)

demo: venv
	$(VENV)/bin/sluice demo

bench: venv
	@$(VPY) -m bench

SOAK_OUT ?= experiments/results/soak
SOAK_ARGS ?=
soak: venv
	$(VPY) -m bench.soak --out $(SOAK_OUT) $(SOAK_ARGS)

clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -path ./.venv-vllm -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
