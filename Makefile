# Two entry points (see README): `make demo` runs the main job on an embedded default, `make test` runs the tests.
# Both create the virtual environment on first use; nothing else needs installing by hand.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
# The tested torch: on a CPU machine pip takes the CPU build; on a GPU machine PyPI's default is the CUDA build.
TORCH_VERSION ?= 2.13.0

.PHONY: demo test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -P -m venv $(VENV)
	$(PY) -P -m pip install --quiet --upgrade pip
	$(PY) -P -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -P -m pip install --quiet -e '.[all,test]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/hybridkv demo

test: $(VENV)/.installed
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" scripts/test.sh

clean:
	rm -rf $(VENV) build *.egg-info
