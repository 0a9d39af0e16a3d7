# The two set-up commands: `make test` and `make demo`. Each installs what it needs first
# (a virtualenv in .venv with the CPU build of torch, and libturbojpeg where apt can add it),
# and is quick when everything is already installed.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO   ?= demo
# sample photos make demo generates (tests/test_readme.py runs the demo with fewer)
DEMO_COUNT ?= 2000

.PHONY: install system-deps emulators test test-fast demo demo-datasets lint fuzz clean bench-report

install: $(STAMP)

$(STAMP): pyproject.toml setup.py packer/images/_jpegregion.c packer/formats/_safecopy.c requirements/test.txt requirements/test-no-deps.txt
	@$(MAKE) --no-print-directory system-deps
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU torch first, from the local wheel cache: a bare `torch` could pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,plot,dask]'
	# Libraries the interop tests run packer with (Lightning, torchdata, WebDataset, Hugging Face, DALI).
	$(BIN)/pip install -q -r requirements/test.txt
	$(BIN)/pip install -q --no-deps -r requirements/test-no-deps.txt
	@touch $(STAMP)

# Azurite, the Azure Blob emulator the az:// tests start (tests/support/emulators.py), in .tools/azurite (git-ignored),
# installed by make test (make demo does not need it); without npm the tests skip (and fail under CI: --require-emulators).
emulators:
	@if [ -e .tools/azurite/node_modules/.bin/azurite-blob ]; then :; \
	elif command -v npm >/dev/null; then npm install -s --prefix .tools/azurite azurite@3.37.0 >/dev/null \
	  || echo "packer: npm could not install azurite; the az:// emulator tests will skip"; \
	else echo "packer: npm not found; the az:// emulator tests will skip (tests/storage/test_gcs_azure.py)"; fi

# libturbojpeg (libjpeg-turbo's TurboJPEG API) for fast JPEG decoding. Optional: without it
# packer decodes with Pillow and says so once.
# libjpeg's headers (libjpeg62-turbo-dev) let `pip install -e .` build the JPEG region decoder
# (packer/images/_jpegregion.c, setup.py). Optional too: without them crops decode the whole image.
system-deps:
	@if ldconfig -p 2>/dev/null | grep -q 'libturbojpeg\.so'; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing libturbojpeg0 with apt-get"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q libturbojpeg0 >/dev/null 2>&1 \
	  || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libturbojpeg0 >/dev/null 2>&1; } \
	  || echo "packer: could not install libturbojpeg0; JPEG decoding will use Pillow"; \
	else echo "packer: libturbojpeg not found and not installable here (see README: Install); JPEG decoding will use Pillow"; fi
	@if [ -f /usr/include/jpeglib.h ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing libjpeg62-turbo-dev with apt-get"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q libjpeg62-turbo-dev >/dev/null 2>&1 \
	  || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libjpeg62-turbo-dev >/dev/null 2>&1; } \
	  || echo "packer: could not install libjpeg62-turbo-dev; crops will decode whole JPEGs"; \
	else echo "packer: libjpeg headers not found and not installable here; crops will decode whole JPEGs"; fi

# In CI, and wherever ldconfig lists libturbojpeg, the suite must run the libjpeg-turbo path:
# --require-turbojpeg makes tests fail (not skip) when the library does not load.
# (Expanded when the recipe runs, i.e. after system-deps has installed what it could.)
REQUIRE_TURBOJPEG = $(if $(CI),--require-turbojpeg,$(shell ldconfig -p 2>/dev/null | grep -q 'libturbojpeg\.so' && echo --require-turbojpeg))

# Likewise the compiled JPEG region decoder, wherever libjpeg's headers are there to build it.
REQUIRE_JPEGREGION = $(if $(CI),--require-jpegregion,$(shell test -f /usr/include/jpeglib.h && echo --require-jpegregion))

# In CI the storage emulators must be there: the az:// tests fail (not skip) without them.
REQUIRE_EMULATORS = $(if $(CI),--require-emulators)

# The test files run on one pytest-xdist worker per core (-n auto), each file whole on one worker (its module
# fixtures built once), in tests/conftest.py's order (the files holding slow tests first): pytest-xdist would
# otherwise reorder files by their number of tests, and the pasted README (5 tests, 2-4 minutes) started last.
XDIST = -n auto --dist loadfile --no-loadscope-reorder

test: install emulators
	$(BIN)/python -m pytest -q $(XDIST) $(REQUIRE_TURBOJPEG) $(REQUIRE_JPEGREGION) $(REQUIRE_EMULATORS)

# The edit loop: every test that starts no process (tests/procs.txt lists those that do; --no-procs fails any
# other test that starts one). make test runs them all.
test-fast: install emulators
	$(BIN)/python -m pytest -q $(XDIST) --no-procs $(REQUIRE_TURBOJPEG) $(REQUIRE_JPEGREGION) $(REQUIRE_EMULATORS)

# The seeded fuzz test of tests/formats/test_fuzz.py with many more cases (make test runs 120 per format and payload).
FUZZ_CASES ?= 5000
fuzz: install
	$(BIN)/python -m pytest -q -s tests/formats/test_fuzz.py --fuzz-cases $(FUZZ_CASES)

# ruff (line length 120, E501 on) on everything; pyright in basic mode on packer/ (settings in pyproject.toml),
# against this virtualenv's packages.
lint: install
	$(BIN)/ruff check packer tests examples
	$(BIN)/pyright --pythonpath $(BIN)/python

# Sample data -> five of the formats (DEMO_SETS) -> verify -> benchmark. Outputs land in $(DEMO)/ (about 1.6 GB).
# A second run reuses the sample set, every dataset whose source and options did not change
# (--if-changed; it says "reused ...") and the benchmark when no dataset was converted again.
DEMO_SETS := $(foreach f,lmdb hdf5 memmap bmp mosaic,$(DEMO)/imgs.$(f))

demo: install demo-datasets $(DEMO)/bench.json

demo-datasets:
	@mkdir -p $(DEMO)
	@test -d $(DEMO)/imgs || $(BIN)/packer sample $(DEMO)/imgs --count $(DEMO_COUNT) --classes 10
	$(BIN)/packer convert $(DEMO)/imgs --to lmdb --if-changed --overwrite
	$(BIN)/packer convert $(DEMO)/imgs --to hdf5 --if-changed --overwrite
	$(BIN)/packer convert $(DEMO)/imgs --to memmap --if-changed --overwrite
	$(BIN)/packer convert $(DEMO)/imgs --to bmp --resize 256 --if-changed --overwrite
	$(BIN)/packer convert $(DEMO)/imgs --to mosaic --tile 224x224 --if-changed --overwrite
	$(BIN)/packer info $(DEMO)/imgs.lmdb
	$(BIN)/packer verify $(DEMO)/imgs.lmdb --against $(DEMO)/imgs -q

# Measured again only when a dataset was (re)converted: a reused one keeps its manifest's time.
$(DEMO)/bench.json: $(addsuffix /manifest.json,$(DEMO_SETS))
	$(BIN)/packer bench $(DEMO)/imgs $(DEMO_SETS) --levels read,decode --orders shuffle,block --repeats 1 -q \
	  --json $(DEMO)/bench.json --plot $(DEMO)/bench.png

# examples/bench_report.md (+ bench*.png, bench*.json): sample set -> every format -> packer bench,
# as is and under an emulated hard disk (root). Run on a quiet machine; takes several minutes.
bench-report: install
	$(BIN)/python examples/make_bench_report.py

clean:
	rm -rf $(VENV) $(DEMO) bench-work .pytest_cache *.egg-info
